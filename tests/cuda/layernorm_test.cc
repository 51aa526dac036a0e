// CUDA LayerNorm (forward, residual + LayerNorm, backward) against the CPU
// op in f64 on the same rounded inputs, for every storage dtype.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|:
// - y: the kernel's statistics are float sums of C terms (relative error
//   ~1e-6 of the row's scale, |x| <= ~8 here), so xhat carries ~1e-6 of its
//   size (|xhat| <= ~5) and y = xhat w + b about 1e-5 absolute at most:
//   atol 2e-5. Storing y rounds once more: rtol = u_S + 1e-6.
// - mean, rstd: f32 outputs for every storage dtype; the same float sums
//   give ~1e-6 relative (rtol 1e-5), atol 1e-6 for means near zero.
// - dx: two float row sums of C products (|dy w| <= ~10, |xhat| <= ~5),
//   each relative ~1e-6 of its scale, give ~1e-5 absolute: atol 5e-5;
//   rtol = u_S + 1e-6 for the rounded store (with Accumulate, one rounding
//   of the sum, as the kernel adds in float before storing).
// - dw, db: float sums of N terms of size ~1, in runs of <= 16 rows and
//   then 8 fixed slices; the worst-case rounding error is about 32 2^-24
//   times the summed magnitudes (~N), so atol = 2e-6 N (2e-3 for N = 1000,
//   where a lost row or block would be off by ~1); rtol = u_G + 1e-6 for
//   the gradient dtype G.
// A wrong formula, eps or index is off by 1e-2 or more everywhere.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/layernorm.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

// x shapes: 75 rows (3 x 25) is neither a multiple of the forward's 8 rows
// per block nor of the backward's 16-row runs, C = 100 and 37 are not
// multiples of a warp, and C = 1030 makes every lane loop 33 times.
const std::vector<Shape> kShapes = {{3, 25, 100}, {5, 37}, {1000, 1030}};

int64_t rows_of(const Shape& s) { return s.numel() / s[s.rank() - 1]; }
int64_t width_of(const Shape& s) { return s[s.rank() - 1]; }

struct Inputs {
  HostTensor x, w, b;  // (.., C), (C), (C)
};

// Rows with mean `shift` and standard deviation `scale`; w around 1.
Inputs make_inputs(const Shape& shape, DType S, uint64_t seed, double scale = 2.0, double shift = 0.5) {
  const int64_t C = width_of(shape);
  return {random_host(shape, S, seed, scale, shift), random_host({C}, S, seed + 1, 0.5, 1.0),
          random_host({C}, S, seed + 2, 0.5)};
}

struct Forward {
  HostTensor y, mean, rstd;
};

// The CPU op in f64 on the (already rounded) inputs.
Forward cpu_forward(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t N = rows_of(x.shape());
  Forward r{HostTensor(x.shape(), DType::F64), HostTensor({N}, DType::F64), HostTensor({N}, DType::F64)};
  layernorm_forward(KernelContext{}, r.y, r.mean, r.rstd, host_cast(x, DType::F64), host_cast(w, DType::F64),
                    host_cast(b, DType::F64));
  return r;
}

void expect_forward(const Forward& ref, const Tensor& y, const Tensor& mean, const Tensor& rstd, DType S,
                    const std::string& what, double y_atol = 2e-5) {
  expect_close(to_host(y), ref.y, y_atol, unit_roundoff(S) + 1e-6, what + " y");
  expect_close(to_host(mean), ref.mean, 1e-6, 1e-5, what + " mean");
  expect_close(to_host(rstd), ref.rstd, 1e-6, 1e-5, what + " rstd");
}

class CudaLayerNormTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaLayerNormTest);

TEST_P(CudaLayerNormTest, Forward) {
  const DType S = GetParam();
  for (const Shape& shape : kShapes) {
    const int64_t N = rows_of(shape);
    Inputs in = make_inputs(shape, S, 100 + uint64_t(N));
    DeviceTensor x = to_device(in.x), w = to_device(in.w), b = to_device(in.b);
    DeviceTensor y(shape, S), mean({N}, DType::F32), rstd({N}, DType::F32);
    cuda::layernorm_forward(ctx(), y, mean, rstd, x, w, b);
    expect_forward(cpu_forward(in.x, in.w, in.b), y, mean, rstd, S, "x " + shape.str());
  }
}

// Rows of variance ~1e-4 around 0.3 (eps is then 10% of the variance, so a
// wrong eps or an unbiased variance moves y by several percent) and rows
// with mean 8 and deviation 0.5. Here the float mean's error (~1e-7 |mean|)
// is amplified by rstd (100 and 2): |mean| rstd ~30 gives ~1e-5 on y, so
// y's atol is 1e-4.
TEST_P(CudaLayerNormTest, SmallVarianceAndLargeMean) {
  const DType S = GetParam();
  const Shape shape{29, 70};
  for (auto [scale, shift] : {std::pair{0.01, 0.3}, std::pair{0.5, 8.0}}) {
    Inputs in = make_inputs(shape, S, 200, scale, shift);
    DeviceTensor x = to_device(in.x), w = to_device(in.w), b = to_device(in.b);
    DeviceTensor y(shape, S), mean({29}, DType::F32), rstd({29}, DType::F32);
    cuda::layernorm_forward(ctx(), y, mean, rstd, x, w, b);
    expect_forward(cpu_forward(in.x, in.w, in.b), y, mean, rstd, S, "shift " + std::to_string(shift), 1e-4);
  }
}

// res = a + b is stored rounded to S (one rounding of the float sum, the
// same as rounding the exact sum through float on the host, and as the CPU
// op in S does, so res must match both bit for bit) and y is LayerNorm of
// that stored res. Then again with res aliasing a, as the model calls it.
TEST_P(CudaLayerNormTest, ResidualForward) {
  const DType S = GetParam();
  for (const Shape& shape : kShapes) {
    const int64_t N = rows_of(shape);
    Inputs in = make_inputs(shape, S, 300 + uint64_t(N));
    HostTensor addend = random_host(shape, S, 399, 1.0);
    std::vector<double> sum = values(in.x), bv = values(addend);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += bv[i];
    HostTensor res_ref = host_from(sum, shape, S);
    const Forward ref = cpu_forward(res_ref, in.w, in.b);
    HostTensor res_cpu(shape, S), y_cpu(shape, S), mean_cpu({N}, DType::F32), rstd_cpu({N}, DType::F32);
    residual_layernorm_forward(cpu(), res_cpu, y_cpu, mean_cpu, rstd_cpu, in.x, addend, in.w, in.b);
    expect_equal(res_cpu, res_ref, "CPU res " + shape.str());

    DeviceTensor a = to_device(in.x), b = to_device(addend), w = to_device(in.w), bias = to_device(in.b);
    DeviceTensor res(shape, S), y(shape, S), mean({N}, DType::F32), rstd({N}, DType::F32);
    cuda::residual_layernorm_forward(ctx(), res, y, mean, rstd, a, b, w, bias);
    expect_equal(to_host(res), res_ref, "res " + shape.str());
    expect_forward(ref, y, mean, rstd, S, "residual " + shape.str());

    DeviceTensor y2(shape, S), mean2({N}, DType::F32), rstd2({N}, DType::F32);
    cuda::residual_layernorm_forward(ctx(), a, y2, mean2, rstd2, a, b, w, bias);
    expect_equal(to_host(a), res_ref, "res aliasing a " + shape.str());
    expect_forward(ref, y2, mean2, rstd2, S, "residual in place " + shape.str());
  }
}

// Every shape, both dx modes, dw/db in f32 and in the storage dtype. The
// saved statistics are the CUDA forward's (f32), as in the model; the CPU
// gets the same values in f64. A second run from the same starting values
// must agree bit for bit (no atomics, fixed reduction order).
TEST_P(CudaLayerNormTest, Backward) {
  const DType S = GetParam();
  for (const Shape& shape : kShapes) {
    const int64_t N = rows_of(shape), C = width_of(shape);
    Inputs in = make_inputs(shape, S, 400 + uint64_t(N));
    DeviceTensor x = to_device(in.x), w = to_device(in.w), b = to_device(in.b);
    DeviceTensor y(shape, S), mean({N}, DType::F32), rstd({N}, DType::F32);
    cuda::layernorm_forward(ctx(), y, mean, rstd, x, w, b);
    HostTensor mean_h = to_host(mean), rstd_h = to_host(rstd);
    HostTensor dy = random_host(shape, S, 401);
    DeviceTensor dy_dev = to_device(dy);

    for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate})
      for (DType G : S == DType::F32 ? std::vector<DType>{S} : std::vector<DType>{DType::F32, S}) {
        const std::string what = "x " + shape.str() + (mode == GradMode::Accumulate ? " accumulate" : " overwrite") +
                                 " grads " + dtype_name(G);
        HostTensor dx0 = random_host(shape, S, 402), dw0 = random_host({C}, G, 403), db0 = random_host({C}, G, 404);
        HostTensor dx_ref = host_cast(dx0, DType::F64), dw_ref = host_cast(dw0, DType::F64),
                   db_ref = host_cast(db0, DType::F64);
        layernorm_backward(cpu(), dx_ref, dw_ref, db_ref, host_cast(dy, DType::F64), host_cast(in.x, DType::F64),
                           host_cast(in.w, DType::F64), host_cast(mean_h, DType::F64),
                           host_cast(rstd_h, DType::F64), mode);

        // With Overwrite, dx starts as NaN (a fresh DeviceTensor): reading it would show.
        auto run = [&](DeviceTensor& dx, DeviceTensor& dw, DeviceTensor& db) {
          dx = mode == GradMode::Accumulate ? to_device(dx0) : DeviceTensor(shape, S);
          dw = to_device(dw0);
          db = to_device(db0);
          cuda::layernorm_backward(ctx(), dx, dw, db, dy_dev, x, w, mean, rstd, mode);
        };
        DeviceTensor dx, dw, db;
        run(dx, dw, db);
        const double ug = unit_roundoff(G) + 1e-6;
        expect_close(to_host(dx), dx_ref, 5e-5, unit_roundoff(S) + 1e-6, what + " dx");
        expect_close(to_host(dw), dw_ref, 2e-6 * double(N), ug, what + " dw");
        expect_close(to_host(db), db_ref, 2e-6 * double(N), ug, what + " db");

        DeviceTensor dx2, dw2, db2;
        run(dx2, dw2, db2);
        expect_equal(to_host(dx2), to_host(dx), what + " dx reproducible");
        expect_equal(to_host(dw2), to_host(dw), what + " dw reproducible");
        expect_equal(to_host(db2), to_host(db), what + " db reproducible");
      }
  }
}

// The dw/db partials live in the context's workspace; one that cannot hold
// a single (2C) row of them is refused before anything is launched, so this
// needs no GPU (the device pointers are never dereferenced).
TEST(CudaLayerNormChecks, BackwardRefusesATooSmallWorkspace) {
  void* fake = reinterpret_cast<void*>(uintptr_t(4096));
  auto dev = [&](Shape s, DType t) { return Tensor(fake, s, t, Device::CUDA); };
  KernelContext ctx;
  ctx.device = Device::CUDA;
  ctx.blas_workspace = fake;
  ctx.blas_workspace_bytes = 100;  // 2 * 37 floats need 296
  expect_error(
      [&] {
        cuda::layernorm_backward(ctx, dev({4, 37}, DType::F32), dev({37}, DType::F32), dev({37}, DType::F32),
                                 dev({4, 37}, DType::F32), dev({4, 37}, DType::F32), dev({37}, DType::F32),
                                 dev({4}, DType::F32), dev({4}, DType::F32), GradMode::Overwrite);
      },
      ErrorKind::Memory, {"layernorm_backward", "296"});
}

}  // namespace
}  // namespace xirang::test
