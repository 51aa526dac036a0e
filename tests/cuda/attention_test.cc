// CUDA causal flash attention, the fp32 CUDA-core kernels (the reference
// and fallback of the tensor-core path, tests/cuda/attention_tc_test.cc),
// against the CPU ops in f64 on the same rounded qkv, for every storage
// dtype: the probability-based pair
// (attention_forward / attention_backward, the exact gradient) and the CPU
// flash pair (flash_attention_forward / flash_attention_backward, which,
// given the CUDA forward's stored `out`, sees exactly what the CUDA
// backward sees). lse is also checked against a float64 log-sum-exp
// computed here from the op's definition.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|, with s the
// input scale (values N(0, s^2)):
// - out: scores are float dot products of D terms (error ~1e-6 s^2 after
//   the 1/sqrt(D) scale), which perturb each probability by that relative
//   amount; out averages values of size s: atol 5e-5 s^2; stored once in S:
//   rtol = u_S + 1e-5.
// - lse (f32 for every dtype): the same score error plus a float log of a
//   float sum: atol 5e-5 s^2, rtol 1e-6.
// - dqkv against the CPU flash backward on the same `out`: float sums over
//   up to T = 130 keys or queries, relative ~1e-5 of the gradient's scale
//   g = max |ref|: atol 2e-5 g; stored once: rtol = u_S + 1e-5.
// - dqkv against the exact gradient: with 16-bit storage `out` is rounded
//   to S before backward uses it (the row term dout . out moves by ~u_S
//   sqrt(D) |dout| |out|, and every dS with it): atol += 2 u_S g.
// A wrong mask, tile edge or head offset is off by a sizeable fraction of
// the scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

struct Case {
  int64_t B, T, H, D;
  double scale;  // of the random q, k, v
  std::string str() const {
    return "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) + " D " +
           std::to_string(D) + " scale " + std::to_string(scale);
  }
};

// T = 70, 130, 45, 67 end in a partial 64-row tile (130 spans three); D =
// 40 is padded to 64 inside the kernels; T = 1 is a single row; scale 3
// gives scores of deviation ~9, so the running max moves by many units
// between key tiles and the online rescaling matters.
const Case kCases[] = {{2, 70, 3, 16, 1.0},  {1, 130, 2, 64, 1.0}, {2, 45, 2, 40, 1.0},
                       {1, 67, 1, 128, 1.0}, {3, 1, 2, 32, 1.0},   {1, 100, 2, 64, 3.0}};

// lse (B, H, T) in float64: log sum_{s <= t} exp(q_t . k_s / sqrt(D)).
std::vector<double> reference_lse(const std::vector<double>& qkv, const Case& c) {
  const int64_t C = c.H * c.D, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(c.D));
  std::vector<double> lse(size_t(c.B * c.H * c.T)), s(size_t(c.T));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t t = 0; t < c.T; ++t) {
        const double* q = &qkv[size_t((b * c.T + t) * C3 + h * c.D)];
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= t; ++j) {
          const double* k = &qkv[size_t((b * c.T + j) * C3 + C + h * c.D)];
          double dot = 0;
          for (int64_t d = 0; d < c.D; ++d) dot += q[d] * k[d];
          s[size_t(j)] = dot * scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        double z = 0;
        for (int64_t j = 0; j <= t; ++j) z += std::exp(s[size_t(j)] - mx);
        lse[size_t((b * c.H + h) * c.T + t)] = mx + std::log(z);
      }
  return lse;
}

class CudaFlashAttentionTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaFlashAttentionTest);

TEST_P(CudaFlashAttentionTest, Forward) {
  const DType S = GetParam();
  for (const Case& c : kCases) {
    const int64_t C = c.H * c.D;
    HostTensor qkv = random_host({c.B, c.T, 3 * C}, S, 700 + uint64_t(c.T), c.scale);
    HostTensor out_ref({c.B, c.T, C}, DType::F64), probs({c.B, c.H, c.T, c.T}, DType::F64);
    attention_forward(cpu(), out_ref, probs, host_cast(qkv, DType::F64), int(c.H));

    DeviceTensor qkv_dev = to_device(qkv), out({c.B, c.T, C}, S), lse({c.B, c.H, c.T}, DType::F32);
    cuda::flash_attention_forward_fp32(ctx(), out, lse, qkv_dev, int(c.H));
    const double atol = 5e-5 * c.scale * c.scale;
    expect_close(to_host(out), out_ref, atol, unit_roundoff(S) + 1e-5, "out " + c.str());
    HostTensor lse_ref = host_from(reference_lse(values(qkv), c), {c.B, c.H, c.T}, DType::F64);
    expect_close(to_host(lse), lse_ref, atol, 1e-6, "lse " + c.str());

    HostTensor out_flash({c.B, c.T, C}, DType::F64), lse_flash({c.B, c.H, c.T}, DType::F64);
    flash_attention_forward(cpu(), out_flash, lse_flash, host_cast(qkv, DType::F64), int(c.H));
    expect_close(to_host(out), out_flash, atol, unit_roundoff(S) + 1e-5, "out vs CPU flash " + c.str());
    expect_close(to_host(lse), lse_flash, atol, 1e-6, "lse vs CPU flash " + c.str());
  }
}

// dqkv starts as NaN (a fresh DeviceTensor), so an element the kernels do
// not write fails. The backward gets the CUDA forward's out and lse, as in
// the model. A second run must agree bit for bit (no atomics).
TEST_P(CudaFlashAttentionTest, Backward) {
  const DType S = GetParam();
  for (const Case& c : kCases) {
    const int64_t C = c.H * c.D;
    HostTensor qkv = random_host({c.B, c.T, 3 * C}, S, 800 + uint64_t(c.T), c.scale);
    HostTensor dout = random_host({c.B, c.T, C}, S, 801);
    HostTensor out_ref({c.B, c.T, C}, DType::F64), probs({c.B, c.H, c.T, c.T}, DType::F64);
    HostTensor dqkv_ref({c.B, c.T, 3 * C}, DType::F64);
    HostTensor qkv64 = host_cast(qkv, DType::F64);
    attention_forward(cpu(), out_ref, probs, qkv64, int(c.H));
    attention_backward(cpu(), dqkv_ref, host_cast(dout, DType::F64), qkv64, probs, int(c.H));

    DeviceTensor qkv_dev = to_device(qkv), dout_dev = to_device(dout);
    DeviceTensor out({c.B, c.T, C}, S), lse({c.B, c.H, c.T}, DType::F32);
    cuda::flash_attention_forward_fp32(ctx(), out, lse, qkv_dev, int(c.H));
    DeviceTensor dqkv({c.B, c.T, 3 * C}, S);
    cuda::flash_attention_backward_fp32(ctx(), dqkv, dout_dev, qkv_dev, out, lse, int(c.H));

    const double g = scale_of(dqkv_ref), u = unit_roundoff(S);
    const double atol = 2e-5 * g + (S == DType::F32 ? 0.0 : 2 * u * g);
    expect_close(to_host(dqkv), dqkv_ref, atol, u + 1e-5, "dqkv " + c.str());

    // The CPU flash backward on the CUDA forward's rounded out and the exact lse.
    HostTensor out_flash({c.B, c.T, C}, DType::F64), lse_flash({c.B, c.H, c.T}, DType::F64);
    flash_attention_forward(cpu(), out_flash, lse_flash, qkv64, int(c.H));
    HostTensor dqkv_flash({c.B, c.T, 3 * C}, DType::F64);
    flash_attention_backward(cpu(), dqkv_flash, host_cast(dout, DType::F64), qkv64,
                             host_cast(to_host(out), DType::F64), lse_flash, int(c.H));
    expect_close(to_host(dqkv), dqkv_flash, 2e-5 * scale_of(dqkv_flash), u + 1e-5, "dqkv vs CPU flash " + c.str());

    DeviceTensor dqkv2({c.B, c.T, 3 * C}, S);
    cuda::flash_attention_backward_fp32(ctx(), dqkv2, dout_dev, qkv_dev, out, lse, int(c.H));
    expect_equal(to_host(dqkv2), to_host(dqkv), "dqkv reproducible " + c.str());
  }
}

// Shape checks run before anything touches the device, so they need no GPU.
TEST(CudaFlashAttentionChecks, RejectsBadShapes) {
  void* fake = reinterpret_cast<void*>(uintptr_t(4096));
  auto dev = [&](Shape s, DType t) { return Tensor(fake, s, t, Device::CUDA); };
  KernelContext ctx;
  ctx.device = Device::CUDA;
  auto expect_shape_error = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "expected a Shape error mentioning '" << part << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Shape) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  // Head dim 256 is beyond the kernels' 128.
  expect_shape_error(
      [&] {
        cuda::flash_attention_forward(ctx, dev({1, 4, 256}, DType::F32), dev({1, 1, 4}, DType::F32),
                                      dev({1, 4, 768}, DType::F32), 1);
      },
      "head dim 256");
  // lse must be f32 even for 16-bit storage.
  expect_shape_error(
      [&] {
        cuda::flash_attention_forward(ctx, dev({1, 4, 64}, DType::BF16), dev({1, 2, 4}, DType::BF16),
                                      dev({1, 4, 192}, DType::BF16), 2);
      },
      "lse");
}

}  // namespace
}  // namespace xirang::test
