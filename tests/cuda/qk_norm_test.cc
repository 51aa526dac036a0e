// CUDA per-head q/k RMSNorm (kernels/qk_norm.h) against the CPU op in f64
// on the same rounded inputs, for every storage dtype.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|, rmsnorm's
// (tests/cuda/rmsnorm_test.cc) for rows of D <= 128:
// - out: rstd comes from a float sum of D squares (relative error ~1e-6),
//   so y = x rstd w carries ~1e-6 of its size (|y| <= ~10 here): atol 2e-5;
//   storing y rounds once more: rtol = u_S + 1e-6. The v heads are copies.
// - rstd: f32 for every storage dtype, ~1e-6 relative: rtol 1e-5.
// - dqkv: one float row sum of D products (|dy w| <= ~10, |xhat| <= ~5),
//   ~1e-5 absolute at most: atol 5e-5; rtol = u_S + 1e-6 (with Accumulate
//   one rounding of the float sum; v's gradient is dout, or dx + dout
//   rounded once).
// - dq_w, dk_w: float sums over M = tokens x heads terms of size ~1, in
//   runs of a few tokens, then 8 fixed slices: atol 2e-6 M (a lost head or
//   block is off by ~1); rtol = u_G + 1e-6 for the gradient dtype G.
// A wrong formula, eps or weight is off by 1e-2 or more.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/qk_norm.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kEpsNorm = 1e-6;  // Qwen3's rms_norm_eps

struct QkShape {
  int64_t B, T, H, KV, D;
  int64_t tokens() const { return B * T; }
  int64_t normed() const { return H + KV; }
  Shape qkv() const { return {B, T, (H + 2 * KV) * D}; }
  Shape rstd() const { return {B, T, H + KV}; }
  std::string str() const {
    return "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) + " KV " +
           std::to_string(KV) + " D " + std::to_string(D);
  }
};

// T of 37 and 53 tokens (no multiple of the 8 heads per forward block or
// the backward's 4-token runs), Qwen3's H 8, KV 2 with D 128 and with D 64;
// a head of 40 (not a multiple of a warp); and 5000 tokens, where the
// backward's 1024-block cap sets the run length.
const std::vector<QkShape> kShapes = {
    {3, 37, 8, 2, 128}, {2, 53, 8, 2, 64}, {1, 19, 3, 1, 40}, {4, 1250, 4, 2, 64}};

struct Forward {
  HostTensor out, rstd;
};

Forward cpu_forward(const QkShape& s, const Tensor& qkv, const Tensor& q_w, const Tensor& k_w, double eps = kEpsNorm) {
  Forward r{HostTensor(s.qkv(), DType::F64), HostTensor(s.rstd(), DType::F64)};
  qk_rmsnorm_forward(KernelContext{}, r.out, r.rstd, host_cast(qkv, DType::F64), host_cast(q_w, DType::F64),
                     host_cast(k_w, DType::F64), int(s.H), int(s.KV), eps);
  return r;
}

void expect_forward(const Forward& ref, const Tensor& out, const Tensor& rstd, DType S, const std::string& what) {
  expect_close(to_host(out), ref.out, 2e-5, unit_roundoff(S) + 1e-6, what + " out");
  expect_close(to_host(rstd), ref.rstd, 1e-6, 1e-5, what + " rstd");
}

struct Inputs {
  HostTensor qkv, q_w, k_w;
};

// Heads with a non-zero mean and scale 2; q_w around 1, k_w around 0.5, so
// a swapped weight shows.
Inputs random_inputs(const QkShape& s, DType S, uint64_t seed, double scale = 2.0) {
  return {random_host(s.qkv(), S, seed, scale, 0.25 * scale), random_host({s.D}, S, seed + 1, 0.5, 1.0),
          random_host({s.D}, S, seed + 2, 0.3, 0.5)};
}

class CudaQkNormTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaQkNormTest);

// Out of place, then in place: the same values bit for bit.
TEST_P(CudaQkNormTest, Forward) {
  const DType S = GetParam();
  for (const QkShape& s : kShapes) {
    Inputs in = random_inputs(s, S, 700 + uint64_t(s.tokens()));
    DeviceTensor qkv = to_device(in.qkv), q_w = to_device(in.q_w), k_w = to_device(in.k_w);
    DeviceTensor out(s.qkv(), S), rstd(s.rstd(), DType::F32);
    cuda::qk_rmsnorm_forward(ctx(), out, rstd, qkv, q_w, k_w, int(s.H), int(s.KV), kEpsNorm);
    expect_forward(cpu_forward(s, in.qkv, in.q_w, in.k_w), out, rstd, S, s.str());

    DeviceTensor rstd2(s.rstd(), DType::F32);
    cuda::qk_rmsnorm_forward(ctx(), qkv, rstd2, qkv, q_w, k_w, int(s.H), int(s.KV), kEpsNorm);
    expect_equal(to_host(qkv), to_host(out), s.str() + " in place");
    expect_equal(to_host(rstd2), to_host(rstd), s.str() + " in-place rstd");
  }
}

// Heads of scale 3e-3, whose mean square is about 1e-5: eps is a real part
// of the denominator, and 1e-6 and 1e-5 must each be the one used.
TEST_P(CudaQkNormTest, SmallHeadsUseEps) {
  const DType S = GetParam();
  const QkShape s{1, 29, 8, 2, 64};
  Inputs in = random_inputs(s, S, 710, 3e-3);
  for (double eps : {1e-5, 1e-6}) {
    DeviceTensor qkv = to_device(in.qkv), q_w = to_device(in.q_w), k_w = to_device(in.k_w);
    DeviceTensor out(s.qkv(), S), rstd(s.rstd(), DType::F32);
    cuda::qk_rmsnorm_forward(ctx(), out, rstd, qkv, q_w, k_w, int(s.H), int(s.KV), eps);
    expect_forward(cpu_forward(s, in.qkv, in.q_w, in.k_w, eps), out, rstd, S, "eps " + std::to_string(eps));
  }
}

// dqkv per mode, dq_w and dk_w in S and F32 on random prior contents, from
// the kernel's own rstd; run twice: bitwise the same. Then Overwrite with
// dqkv = dout: bitwise the separate result.
TEST_P(CudaQkNormTest, Backward) {
  const DType S = GetParam();
  for (const QkShape& s : kShapes) {
    Inputs in = random_inputs(s, S, 720 + uint64_t(s.tokens()));
    DeviceTensor qkv = to_device(in.qkv), q_w = to_device(in.q_w), k_w = to_device(in.k_w);
    DeviceTensor out(s.qkv(), S), rstd(s.rstd(), DType::F32);
    cuda::qk_rmsnorm_forward(ctx(), out, rstd, qkv, q_w, k_w, int(s.H), int(s.KV), kEpsNorm);
    HostTensor rstd_h = to_host(rstd);
    HostTensor dy = random_host(s.qkv(), S, 723);
    DeviceTensor dy_dev = to_device(dy);
    const double q_terms = double(s.tokens() * s.H), k_terms = double(s.tokens() * s.KV);
    for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate})
      for (DType G : S == DType::F32 ? std::vector<DType>{S} : std::vector<DType>{DType::F32, S}) {
        const std::string what =
            s.str() + (mode == GradMode::Accumulate ? " accumulate" : " overwrite") + " dw " + dtype_name(G);
        HostTensor dx0 = random_host(s.qkv(), S, 724), dq0 = random_host({s.D}, G, 725),
                   dk0 = random_host({s.D}, G, 726);
        HostTensor dx_ref = host_cast(dx0, DType::F64), dq_ref = host_cast(dq0, DType::F64),
                   dk_ref = host_cast(dk0, DType::F64);
        qk_rmsnorm_backward(cpu(), dx_ref, dq_ref, dk_ref, host_cast(dy, DType::F64), host_cast(in.qkv, DType::F64),
                            host_cast(in.q_w, DType::F64), host_cast(in.k_w, DType::F64),
                            host_cast(rstd_h, DType::F64), int(s.H), int(s.KV), mode);
        // With Overwrite, dqkv starts as NaN (a fresh DeviceTensor): reading it would show.
        auto run = [&](DeviceTensor& dx, DeviceTensor& dq, DeviceTensor& dk) {
          dx = mode == GradMode::Accumulate ? to_device(dx0) : DeviceTensor(s.qkv(), S);
          dq = to_device(dq0);
          dk = to_device(dk0);
          cuda::qk_rmsnorm_backward(ctx(), dx, dq, dk, dy_dev, qkv, q_w, k_w, rstd, int(s.H), int(s.KV), mode);
        };
        DeviceTensor dx, dq, dk, dx2, dq2, dk2;
        run(dx, dq, dk);
        expect_close(to_host(dx), dx_ref, 5e-5, unit_roundoff(S) + 1e-6, what + " dqkv");
        expect_close(to_host(dq), dq_ref, 2e-6 * q_terms, unit_roundoff(G) + 1e-6, what + " dq_w");
        expect_close(to_host(dk), dk_ref, 2e-6 * k_terms, unit_roundoff(G) + 1e-6, what + " dk_w");
        run(dx2, dq2, dk2);
        expect_equal(to_host(dx2), to_host(dx), what + " dqkv reproducible");
        expect_equal(to_host(dq2), to_host(dq), what + " dq_w reproducible");
        expect_equal(to_host(dk2), to_host(dk), what + " dk_w reproducible");
        if (mode == GradMode::Overwrite) {
          DeviceTensor in_place = to_device(dy), dq3 = to_device(dq0), dk3 = to_device(dk0);
          cuda::qk_rmsnorm_backward(ctx(), in_place, dq3, dk3, in_place, qkv, q_w, k_w, rstd, int(s.H), int(s.KV),
                                    mode);
          expect_equal(to_host(in_place), to_host(dx), what + " dqkv in place");
          expect_equal(to_host(dq3), to_host(dq), what + " dq_w in place");
          expect_equal(to_host(dk3), to_host(dk), what + " dk_w in place");
        }
      }
  }
}

// Checks that run before any launch (no GPU needed: the pointers are never
// dereferenced): a workspace that cannot hold one (2 D) row of partials,
// an f64 rstd (CUDA keeps it in f32), and dqkv = dout with Accumulate.
TEST(CudaQkNormChecks, RefusedBeforeLaunch) {
  void* fake = reinterpret_cast<void*>(uintptr_t(4096));
  auto dev = [&](Shape s, DType t) { return Tensor(fake, s, t, Device::CUDA); };
  KernelContext ctx;
  ctx.device = Device::CUDA;
  ctx.blas_workspace = fake;
  ctx.blas_workspace_bytes = 100;  // 2 x 16 floats need 128
  const Shape qkv{4, 4 * 16}, rstd{4, 3}, w{16};  // H 2, KV 1, D 16
  void* other = reinterpret_cast<void*>(uintptr_t(8192));
  const Tensor dqkv(other, qkv, DType::F32, Device::CUDA);
  expect_error(
      [&] {
        cuda::qk_rmsnorm_backward(ctx, dqkv, dev(w, DType::F32), dev(w, DType::F32), dev(qkv, DType::F32),
                                  dev(qkv, DType::F32), dev(w, DType::F32), dev(w, DType::F32), dev(rstd, DType::F32),
                                  2, 1, GradMode::Overwrite);
      },
      ErrorKind::Memory, {"qk_rmsnorm_backward", "128"});
  expect_error(
      [&] {
        cuda::qk_rmsnorm_forward(ctx, dqkv, dev(rstd, DType::F64), dev(qkv, DType::F32), dev(w, DType::F32),
                                 dev(w, DType::F32), 2, 1, kEpsNorm);
      },
      ErrorKind::Shape, {"qk_rmsnorm_forward", "rstd"});
  expect_error(
      [&] {
        cuda::qk_rmsnorm_backward(ctx, dev(qkv, DType::F32), dev(w, DType::F32), dev(w, DType::F32),
                                  dev(qkv, DType::F32), dqkv, dev(w, DType::F32), dev(w, DType::F32),
                                  dev(rstd, DType::F32), 2, 1, GradMode::Accumulate);
      },
      ErrorKind::Shape, {"qk_rmsnorm_backward", "dout"});
}

}  // namespace
}  // namespace xirang::test
