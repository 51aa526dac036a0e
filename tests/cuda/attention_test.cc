// CUDA causal flash attention, the fp32 CUDA-core kernels (the reference
// and fallback of the tensor-core path, tests/cuda/attention_tc_test.cc),
// for every storage dtype and every head layout: multi-head (MHA),
// grouped-query (GQA: n_head query heads sharing 1 < n_kv_head < n_head
// key/value heads) and multi-query (MQA, one key/value head). References,
// all on the CPU in f64 on the same rounded qkv:
// - the probability-based pair (attention_forward / attention_backward, the
//   exact gradient) on the multi-head qkv in which each query head sees a
//   copy of its key/value head, with dk and dv summed back over each group;
// - the CPU flash pair with n_kv_head (flash_attention_forward /
//   flash_attention_backward, which, given the CUDA forward's stored `out`,
//   sees exactly what the CUDA backward sees), itself checked against a
//   float64 expanded-heads reference in tests/kernels/flash_attention_test.cc;
// - lse: a float64 log-sum-exp computed here from the op's definition.
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
//   g = max |ref|: atol 2e-5 g; with grouped heads dk and dv also sum a
//   group of up to 8 query heads (8 more float additions of terms of the
//   same scale): atol 4e-5 g. Stored once: rtol = u_S + 1e-5.
// - dqkv against the exact gradient: with 16-bit storage `out` is rounded
//   to S before backward uses it (the row term dout . out moves by ~u_S
//   sqrt(D) |dout| |out|, and every dS with it): atol += 2 u_S g.
// A wrong mask, tile edge, head offset or key/value head is off by a
// sizeable fraction of the scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang {
// A DType test parameter prints as its name ("bf16"), not as a byte.
inline void PrintTo(DType t, std::ostream* os) { *os << dtype_name(t); }
}  // namespace xirang

namespace xirang::test {
namespace {

enum class Heads { MHA, GQA, MQA };
const char* heads_name(Heads h) { return h == Heads::MHA ? "MHA" : h == Heads::GQA ? "GQA" : "MQA"; }
void PrintTo(Heads h, std::ostream* os) { *os << heads_name(h); }

// T = 70, 130, 45, 67 end in a partial 64-row tile (130 spans three); D =
// 40 is padded to 64 inside the kernels; T = 1 is a single row; scale 3
// gives scores of deviation ~9, so the running max moves by many units
// between key tiles and the online rescaling matters. GQA: groups of 2 and
// 3 (4, 6 and 8 query heads); MQA: 2, 4 and 8 query heads on one key/value
// head.
const std::vector<AttentionCase>& cases_of(Heads h) {
  static const std::vector<AttentionCase> mha{{2, 70, 3, 3, 16, 1.0}, {1, 130, 2, 2, 64, 1.0}, {2, 45, 2, 2, 40, 1.0},
                                              {1, 67, 1, 1, 128, 1.0}, {3, 1, 2, 2, 32, 1.0},  {1, 100, 2, 2, 64, 3.0}};
  static const std::vector<AttentionCase> gqa{{2, 70, 4, 2, 16, 1.0}, {2, 45, 6, 2, 40, 1.0}, {3, 1, 4, 2, 32, 1.0},
                                              {2, 64, 8, 4, 32, 1.0}, {1, 100, 6, 3, 64, 3.0}};
  static const std::vector<AttentionCase> mqa{{1, 130, 4, 1, 64, 1.0}, {1, 67, 2, 1, 128, 1.0},
                                              {1, 100, 8, 1, 64, 3.0}};
  return h == Heads::MHA ? mha : h == Heads::GQA ? gqa : mqa;
}

// The multi-head qkv (B, T, 3 H D) in which query head h sees key/value
// head h / (H / KV); for MHA a copy.
std::vector<double> expand_kv(const std::vector<double>& qkv, const AttentionCase& c) {
  const int64_t C = c.C(), W = c.W(), G = c.H / c.KV;
  std::vector<double> r(size_t(c.B * c.T * 3 * C));
  for (int64_t bt = 0; bt < c.B * c.T; ++bt)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t d = 0; d < c.D; ++d) {
        const int64_t g = h / G;
        r[size_t(bt * 3 * C + h * c.D + d)] = qkv[size_t(bt * W + h * c.D + d)];
        r[size_t(bt * 3 * C + C + h * c.D + d)] = qkv[size_t(bt * W + C + g * c.D + d)];
        r[size_t(bt * 3 * C + 2 * C + h * c.D + d)] = qkv[size_t(bt * W + C + (c.KV + g) * c.D + d)];
      }
  return r;
}

// A multi-head gradient (B, T, 3 H D) folded into the grouped layout: dq as
// is, dk and dv of key/value head g summed over its query heads.
std::vector<double> fold_grads(const std::vector<double>& d3, const AttentionCase& c) {
  const int64_t C = c.C(), W = c.W(), G = c.H / c.KV;
  std::vector<double> r(size_t(c.B * c.T * W), 0.0);
  for (int64_t bt = 0; bt < c.B * c.T; ++bt)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t d = 0; d < c.D; ++d) {
        const int64_t g = h / G;
        r[size_t(bt * W + h * c.D + d)] = d3[size_t(bt * 3 * C + h * c.D + d)];
        r[size_t(bt * W + C + g * c.D + d)] += d3[size_t(bt * 3 * C + C + h * c.D + d)];
        r[size_t(bt * W + C + (c.KV + g) * c.D + d)] += d3[size_t(bt * 3 * C + 2 * C + h * c.D + d)];
      }
  return r;
}

// lse (B, H, T) in float64: log sum_{s <= t} exp(q_t . k_s / sqrt(D)), k
// of the query head's key/value head.
std::vector<double> reference_lse(const std::vector<double>& qkv, const AttentionCase& c) {
  const int64_t C = c.C(), W = c.W(), G = c.H / c.KV;
  const double scale = 1.0 / std::sqrt(double(c.D));
  std::vector<double> lse(size_t(c.B * c.H * c.T)), s(size_t(c.T));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t t = 0; t < c.T; ++t) {
        const double* q = &qkv[size_t((b * c.T + t) * W + h * c.D)];
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= t; ++j) {
          const double* k = &qkv[size_t((b * c.T + j) * W + C + (h / G) * c.D)];
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

// The probability-based pair on the expanded heads: out (B, T, C) and,
// given dout, the exact gradient folded to (B, T, W).
struct ExactAttention {
  HostTensor out, dqkv;
};
ExactAttention exact_attention(const HostTensor& qkv, const AttentionCase& c, const HostTensor* dout = nullptr) {
  const int64_t C = c.C();
  HostTensor q3 = host_from(expand_kv(values(qkv), c), {c.B, c.T, 3 * C}, DType::F64);
  ExactAttention r{HostTensor({c.B, c.T, C}, DType::F64), HostTensor()};
  HostTensor probs({c.B, c.H, c.T, c.T}, DType::F64);
  attention_forward(KernelContext{}, r.out, probs, q3, int(c.H));
  if (dout) {
    HostTensor d3({c.B, c.T, 3 * C}, DType::F64);
    attention_backward(KernelContext{}, d3, host_cast(*dout, DType::F64), q3, probs, int(c.H));
    r.dqkv = host_from(fold_grads(values(d3), c), {c.B, c.T, c.W()}, DType::F64);
  }
  return r;
}

class CudaFlashAttentionTest : public CudaTest, public ::testing::WithParamInterface<std::tuple<DType, Heads>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  Heads heads() const { return std::get<1>(GetParam()); }
  // atol of dqkv against the CPU flash backward, per g (see the top).
  double dqkv_atol() const { return heads() == Heads::MHA ? 2e-5 : 4e-5; }
};

std::string attention_param_name(const ::testing::TestParamInfo<std::tuple<DType, Heads>>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" + heads_name(std::get<1>(info.param));
}
INSTANTIATE_TEST_SUITE_P(Layouts, CudaFlashAttentionTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16, DType::F16),
                                            ::testing::Values(Heads::MHA, Heads::GQA, Heads::MQA)),
                         attention_param_name);

TEST_P(CudaFlashAttentionTest, Forward) {
  const DType S = dtype();
  for (const AttentionCase& c : cases_of(heads())) {
    const int64_t C = c.C(), W = c.W(), H = c.H, KV = c.KV;
    HostTensor qkv = random_host({c.B, c.T, W}, S, 700 + uint64_t(c.T + W), c.scale);
    HostTensor qkv64 = host_cast(qkv, DType::F64);
    ExactAttention exact = exact_attention(qkv, c);

    DeviceTensor qkv_dev = to_device(qkv), out({c.B, c.T, C}, S), lse({c.B, H, c.T}, DType::F32);
    cuda::flash_attention_forward_fp32(ctx(), out, lse, qkv_dev, int(H), int(KV));
    const double atol = 5e-5 * c.scale * c.scale, u = unit_roundoff(S);
    expect_close(to_host(out), exact.out, atol, u + 1e-5, "out " + c.str());
    HostTensor lse_ref = host_from(reference_lse(values(qkv64), c), {c.B, H, c.T}, DType::F64);
    expect_close(to_host(lse), lse_ref, atol, 1e-6, "lse " + c.str());

    HostTensor out_flash({c.B, c.T, C}, DType::F64), lse_flash({c.B, H, c.T}, DType::F64);
    flash_attention_forward(cpu(), out_flash, lse_flash, qkv64, int(H), int(KV));
    expect_close(to_host(out), out_flash, atol, u + 1e-5, "out vs CPU flash " + c.str());
    expect_close(to_host(lse), lse_flash, atol, 1e-6, "lse vs CPU flash " + c.str());
  }
}

// dqkv starts as NaN (a fresh DeviceTensor), so an element the kernels do
// not write fails. The backward gets the CUDA forward's out and lse, as in
// the model. A second run must agree bit for bit (no atomics).
TEST_P(CudaFlashAttentionTest, Backward) {
  const DType S = dtype();
  for (const AttentionCase& c : cases_of(heads())) {
    const int64_t C = c.C(), W = c.W(), H = c.H, KV = c.KV;
    HostTensor qkv = random_host({c.B, c.T, W}, S, 800 + uint64_t(c.T + W), c.scale);
    HostTensor dout = random_host({c.B, c.T, C}, S, 801);
    HostTensor qkv64 = host_cast(qkv, DType::F64);
    ExactAttention exact = exact_attention(qkv, c, &dout);

    DeviceTensor qkv_dev = to_device(qkv), dout_dev = to_device(dout);
    DeviceTensor out({c.B, c.T, C}, S), lse({c.B, H, c.T}, DType::F32);
    cuda::flash_attention_forward_fp32(ctx(), out, lse, qkv_dev, int(H), int(KV));
    DeviceTensor dqkv({c.B, c.T, W}, S);
    cuda::flash_attention_backward_fp32(ctx(), dqkv, dout_dev, qkv_dev, out, lse, int(H), int(KV));

    const double g = scale_of(exact.dqkv), u = unit_roundoff(S);
    const double atol = dqkv_atol() * g + (S == DType::F32 ? 0.0 : 2 * u * g);
    expect_close(to_host(dqkv), exact.dqkv, atol, u + 1e-5, "dqkv " + c.str());

    // The CPU flash backward on the CUDA forward's rounded out and the exact lse.
    HostTensor out_flash({c.B, c.T, C}, DType::F64), lse_flash({c.B, H, c.T}, DType::F64);
    flash_attention_forward(cpu(), out_flash, lse_flash, qkv64, int(H), int(KV));
    HostTensor dqkv_flash({c.B, c.T, W}, DType::F64);
    flash_attention_backward(cpu(), dqkv_flash, host_cast(dout, DType::F64), qkv64,
                             host_cast(to_host(out), DType::F64), lse_flash, int(H), int(KV));
    expect_close(to_host(dqkv), dqkv_flash, dqkv_atol() * scale_of(dqkv_flash), u + 1e-5,
                 "dqkv vs CPU flash " + c.str());

    DeviceTensor dqkv2({c.B, c.T, W}, S);
    cuda::flash_attention_backward_fp32(ctx(), dqkv2, dout_dev, qkv_dev, out, lse, int(H), int(KV));
    expect_equal(to_host(dqkv2), to_host(dqkv), "dqkv reproducible " + c.str());
  }
}

// n_kv_head = n_head gives the bytes of the multi-head call.
class CudaFlashAttentionDTypeTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaFlashAttentionDTypeTest);

TEST_P(CudaFlashAttentionDTypeTest, KvEqualToHeadsIsTheDefault) {
  const DType S = GetParam();
  const int64_t B = 2, T = 70, H = 3, D = 32, C = H * D;
  HostTensor qkv = random_host({B, T, 3 * C}, S, 911), dout = random_host({B, T, C}, S, 912);
  DeviceTensor qkv_dev = to_device(qkv), dout_dev = to_device(dout);
  DeviceTensor out1({B, T, C}, S), lse1({B, H, T}, DType::F32), d1({B, T, 3 * C}, S);
  DeviceTensor out2({B, T, C}, S), lse2({B, H, T}, DType::F32), d2({B, T, 3 * C}, S);
  cuda::flash_attention_forward_fp32(ctx(), out1, lse1, qkv_dev, int(H));
  cuda::flash_attention_backward_fp32(ctx(), d1, dout_dev, qkv_dev, out1, lse1, int(H));
  cuda::flash_attention_forward_fp32(ctx(), out2, lse2, qkv_dev, int(H), int(H));
  cuda::flash_attention_backward_fp32(ctx(), d2, dout_dev, qkv_dev, out2, lse2, int(H), int(H));
  expect_equal(to_host(out2), to_host(out1), "out");
  expect_equal(to_host(lse2), to_host(lse1), "lse");
  expect_equal(to_host(d2), to_host(d1), "dqkv");
}

// Shape checks run before anything touches the device, so they need no GPU.
void expect_shape_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected a Shape error mentioning '" << part << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Shape) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

Tensor fake_device(Shape s, DType t) { return Tensor(reinterpret_cast<void*>(uintptr_t(4096)), s, t, Device::CUDA); }

KernelContext cuda_context() {
  KernelContext ctx;
  ctx.device = Device::CUDA;
  return ctx;
}

TEST(CudaFlashAttentionChecks, RejectsBadShapes) {
  const KernelContext ctx = cuda_context();
  // Head dim 256 is beyond the kernels' 128.
  expect_shape_error(
      [&] {
        cuda::flash_attention_forward(ctx, fake_device({1, 4, 256}, DType::F32), fake_device({1, 1, 4}, DType::F32),
                                      fake_device({1, 4, 768}, DType::F32), 1);
      },
      "head dim 256");
  // lse must be f32 even for 16-bit storage.
  expect_shape_error(
      [&] {
        cuda::flash_attention_forward(ctx, fake_device({1, 4, 64}, DType::BF16), fake_device({1, 2, 4}, DType::BF16),
                                      fake_device({1, 4, 192}, DType::BF16), 2);
      },
      "lse");
}

TEST(CudaFlashAttentionChecks, RejectsBadHeadCounts) {
  const KernelContext ctx = cuda_context();
  expect_shape_error(
      [&] {
        cuda::flash_attention_forward(ctx, fake_device({1, 4, 24}, DType::F32), fake_device({1, 6, 4}, DType::F32),
                                      fake_device({1, 4, 56}, DType::F32), 6, 4);
      },
      "n_head 6 is not a positive multiple of n_kv_head 4");
  expect_shape_error(
      [&] {
        cuda::flash_attention_backward(ctx, fake_device({1, 4, 50}, DType::F32), fake_device({1, 4, 16}, DType::F32),
                                       fake_device({1, 4, 50}, DType::F32), fake_device({1, 4, 16}, DType::F32),
                                       fake_device({1, 4, 4}, DType::F32), 4, 2);
      },
      "(n_head + 2 n_kv_head) head_dim");
}

}  // namespace
}  // namespace xirang::test
