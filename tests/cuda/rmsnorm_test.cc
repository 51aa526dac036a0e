// CUDA RMSNorm (forward, residual + RMSNorm, backward) against the CPU op
// in f64 on the same rounded inputs, for every storage dtype.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|:
// - y: rstd comes from a float sum of C squares (relative error ~1e-6), so
//   y = x rstd w carries ~1e-6 of its size (|y| <= ~10 here): atol 2e-5;
//   storing y rounds once more: rtol = u_S + 1e-6.
// - rstd: f32 for every storage dtype, ~1e-6 relative: rtol 1e-5.
// - dx: one float row sum of C products (|dy w| <= ~10, |xhat| <= ~5),
//   ~1e-5 absolute at most: atol 5e-5; rtol = u_S + 1e-6 (with
//   Accumulate one rounding of the float sum).
// - dw: float sums of N terms of size ~1 in runs of <= 16 rows, then 8
//   fixed slices: atol 2e-6 N (a lost row or block is off by ~1);
//   rtol = u_G + 1e-6 for the gradient dtype G.
// A wrong formula or eps is off by 1e-2 or more.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/rmsnorm.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kEpsNorm = 1e-5;

// 75 rows (3 x 25): neither a multiple of 8 rows per forward block nor of
// the backward's 16-row runs; widths that are not multiples of a warp; and
// 4096 (the 8B model's width) over 300 rows.
const std::vector<Shape> kShapes = {{3, 25, 100}, {5, 37}, {300, 4096}};

int64_t rows_of(const Shape& s) { return s.numel() / s[s.rank() - 1]; }
int64_t width_of(const Shape& s) { return s[s.rank() - 1]; }

struct Forward {
  HostTensor y, rstd;
};

Forward cpu_forward(const Tensor& x, const Tensor& w, double eps = kEpsNorm) {
  const int64_t N = rows_of(x.shape());
  Forward r{HostTensor(x.shape(), DType::F64), HostTensor({N}, DType::F64)};
  rmsnorm_forward(KernelContext{}, r.y, r.rstd, host_cast(x, DType::F64), host_cast(w, DType::F64), eps);
  return r;
}

void expect_forward(const Forward& ref, const Tensor& y, const Tensor& rstd, DType S, const std::string& what) {
  expect_close(to_host(y), ref.y, 2e-5, unit_roundoff(S) + 1e-6, what + " y");
  expect_close(to_host(rstd), ref.rstd, 1e-6, 1e-5, what + " rstd");
}

class CudaRmsNormTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaRmsNormTest);

TEST_P(CudaRmsNormTest, Forward) {
  const DType S = GetParam();
  for (const Shape& shape : kShapes) {
    const int64_t N = rows_of(shape), C = width_of(shape);
    HostTensor xh = random_host(shape, S, 500 + uint64_t(N), 2.0, 0.5), wh = random_host({C}, S, 501, 0.5, 1.0);
    DeviceTensor x = to_device(xh), w = to_device(wh), y(shape, S), rstd({N}, DType::F32);
    cuda::rmsnorm_forward(ctx(), y, rstd, x, w, kEpsNorm);
    expect_forward(cpu_forward(xh, wh), y, rstd, S, "x " + shape.str());
  }
}

// Rows of scale 3e-3, whose mean square is about eps: eps is half the
// denominator, and 1e-6 (not the default 1e-5) must be the one used.
TEST_P(CudaRmsNormTest, SmallRowsUseEps) {
  const DType S = GetParam();
  const Shape shape{29, 70};
  HostTensor xh = random_host(shape, S, 510, 3e-3), wh = random_host({70}, S, 511, 0.5, 1.0);
  for (double eps : {1e-5, 1e-6}) {
    DeviceTensor x = to_device(xh), w = to_device(wh), y(shape, S), rstd({29}, DType::F32);
    cuda::rmsnorm_forward(ctx(), y, rstd, x, w, eps);
    expect_forward(cpu_forward(xh, wh, eps), y, rstd, S, "eps " + std::to_string(eps));
  }
}

// res = a + b stored rounded to S must match the host's rounding bit for
// bit; y is RMSNorm of that res. Then with res aliasing a.
TEST_P(CudaRmsNormTest, ResidualForward) {
  const DType S = GetParam();
  for (const Shape& shape : kShapes) {
    const int64_t N = rows_of(shape), C = width_of(shape);
    HostTensor ah = random_host(shape, S, 520 + uint64_t(N), 1.5), bh = random_host(shape, S, 521),
               wh = random_host({C}, S, 522, 0.5, 1.0);
    std::vector<double> sum = values(ah), bv = values(bh);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += bv[i];
    HostTensor res_ref = host_from(sum, shape, S);
    const Forward ref = cpu_forward(res_ref, wh);

    DeviceTensor a = to_device(ah), b = to_device(bh), w = to_device(wh);
    DeviceTensor res(shape, S), y(shape, S), rstd({N}, DType::F32);
    cuda::residual_rmsnorm_forward(ctx(), res, y, rstd, a, b, w, kEpsNorm);
    expect_equal(to_host(res), res_ref, "res " + shape.str());
    expect_forward(ref, y, rstd, S, "residual " + shape.str());

    DeviceTensor y2(shape, S), rstd2({N}, DType::F32);
    cuda::residual_rmsnorm_forward(ctx(), a, y2, rstd2, a, b, w, kEpsNorm);
    expect_equal(to_host(a), res_ref, "res aliasing a " + shape.str());
    expect_forward(ref, y2, rstd2, S, "residual in place " + shape.str());
  }
}

// dx per mode, dw in S and F32 on random prior contents, from the kernel's
// own rstd; run twice: bitwise the same.
TEST_P(CudaRmsNormTest, Backward) {
  const DType S = GetParam();
  for (const Shape& shape : kShapes) {
    const int64_t N = rows_of(shape), C = width_of(shape);
    HostTensor xh = random_host(shape, S, 530 + uint64_t(N), 2.0, 0.5), wh = random_host({C}, S, 531, 0.5, 1.0);
    DeviceTensor x = to_device(xh), w = to_device(wh), y(shape, S), rstd({N}, DType::F32);
    cuda::rmsnorm_forward(ctx(), y, rstd, x, w, kEpsNorm);
    HostTensor rstd_h = to_host(rstd);
    HostTensor dy = random_host(shape, S, 532);
    DeviceTensor dy_dev = to_device(dy);
    for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate})
      for (DType G : S == DType::F32 ? std::vector<DType>{S} : std::vector<DType>{DType::F32, S}) {
        const std::string what = "x " + shape.str() + (mode == GradMode::Accumulate ? " accumulate" : " overwrite") +
                                 " dw " + dtype_name(G);
        HostTensor dx0 = random_host(shape, S, 533), dw0 = random_host({C}, G, 534);
        HostTensor dx_ref = host_cast(dx0, DType::F64), dw_ref = host_cast(dw0, DType::F64);
        rmsnorm_backward(cpu(), dx_ref, dw_ref, host_cast(dy, DType::F64), host_cast(xh, DType::F64),
                         host_cast(wh, DType::F64), host_cast(rstd_h, DType::F64), mode);
        // With Overwrite, dx starts as NaN (a fresh DeviceTensor): reading it would show.
        auto run = [&](DeviceTensor& dx, DeviceTensor& dw) {
          dx = mode == GradMode::Accumulate ? to_device(dx0) : DeviceTensor(shape, S);
          dw = to_device(dw0);
          cuda::rmsnorm_backward(ctx(), dx, dw, dy_dev, x, w, rstd, mode);
        };
        DeviceTensor dx, dw, dx2, dw2;
        run(dx, dw);
        expect_close(to_host(dx), dx_ref, 5e-5, unit_roundoff(S) + 1e-6, what + " dx");
        expect_close(to_host(dw), dw_ref, 2e-6 * double(N), unit_roundoff(G) + 1e-6, what + " dw");
        run(dx2, dw2);
        expect_equal(to_host(dx2), to_host(dx), what + " dx reproducible");
        expect_equal(to_host(dw2), to_host(dw), what + " dw reproducible");
      }
  }
}

// A workspace that cannot hold one (C) row of partials is refused before
// anything is launched (no GPU needed: the pointers are never dereferenced).
TEST(CudaRmsNormChecks, BackwardRefusesATooSmallWorkspace) {
  void* fake = reinterpret_cast<void*>(uintptr_t(4096));
  auto dev = [&](Shape s, DType t) { return Tensor(fake, s, t, Device::CUDA); };
  KernelContext ctx;
  ctx.device = Device::CUDA;
  ctx.blas_workspace = fake;
  ctx.blas_workspace_bytes = 100;  // 37 floats need 148
  expect_error(
      [&] {
        cuda::rmsnorm_backward(ctx, dev({4, 37}, DType::F32), dev({37}, DType::F32), dev({4, 37}, DType::F32),
                               dev({4, 37}, DType::F32), dev({37}, DType::F32), dev({4}, DType::F32),
                               GradMode::Overwrite);
      },
      ErrorKind::Memory, {"rmsnorm_backward", "148"});
}

}  // namespace
}  // namespace xirang::test
