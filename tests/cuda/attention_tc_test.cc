// The tensor-core flash attention (kernels/cuda/attention_tc.cu, bf16 and
// f16) against the CPU flash pair in f64 on the same rounded inputs, and the
// rule that picks it (flash_attention_path).
//
// Tolerances. S = Q K^T and dP = dO V^T multiply the stored 16-bit inputs
// exactly and sum in float, as the fp32 kernels do (error ~1e-6 s^2 per
// score); the new error is that P (for O and dV) and dS (for dK and dQ) are
// rounded to the storage type, unit roundoff u, before their product: a
// relative error |delta| <= u on every term of those sums.
// - out = sum_j p_j (1 + delta_j) v_j / l with l summed from unrounded p, so
//   |error| <= u sum_j p_j |v_j| / l <= u max |v|; an f16 P below 2^-14 is
//   subnormal, absolute error <= 2^-25 per term, at most T 2^-25 max |v| in
//   all. atol = (u + T 2^-25) max |v| + 5e-5 s^2 (the float score error, as
//   in attention_test.cc), rtol = u + 1e-5 (out is stored once in S).
// - lse is float from unrounded P: the fp32 kernels' rule, atol 5e-5 s^2
//   plus 5e-5 for float sums over up to 8192 keys, rtol 1e-6. It pins the
//   mask: one key too many or too few moves lse by ~1 / T >= 1.2e-4.
// - dqkv: each element is a sum of terms t_n with independent rounding
//   errors, rms error (u / sqrt 3) sqrt(sum t_n^2), about 0.6 u of the
//   element's own scale; over ~1e5 elements the largest is within 5 sigma,
//   3 u g with g = max |ref|: atol 6 u g, rtol u + 1e-5 (stored once).
// - Every tensor also passes a norm test: ||got - ref|| <= (2 u + 1e-5)
//   ||ref||, against an expected ~0.8 u (product rounding and the final
//   store, each ~0.6 u rms, in quadrature); a wrong tile edge or head shows
//   here even where the per-element floor is loose.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

using TcCase = AttentionCase;

// Head dims 64 and 128 at T = 67, 130 (partial last tiles, 130 spans three)
// and 1024, multi-head and GQA (8 query heads on 2 key/value heads); 32 and
// 96 at the short lengths; one case at scale 2 where the running max moves
// between key tiles.
std::vector<TcCase> tc_cases() {
  std::vector<TcCase> cases;
  for (int64_t D : {64, 128})
    for (int64_t T : {67, 130, 1024}) {
      const int64_t B = T > 200 ? 1 : 2;
      cases.push_back({B, T, 4, 4, D, 1.0});
      cases.push_back({B, T, 8, 2, D, 1.0});
    }
  for (int64_t D : {32, 96}) {
    cases.push_back({2, 67, 4, 4, D, 1.0});
    cases.push_back({1, 130, 8, 2, D, 1.0});
  }
  cases.push_back({1, 130, 4, 1, 64, 2.0});
  return cases;
}

// ||got - ref||_2 <= rel ||ref||_2; NaN fails.
void expect_norm_close(const Tensor& got, const Tensor& ref, double rel, const std::string& what) {
  const std::vector<double> g = values(got), r = values(ref);
  ASSERT_EQ(g.size(), r.size()) << what;
  double err = 0, norm = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    err += (g[i] - r[i]) * (g[i] - r[i]);
    norm += r[i] * r[i];
  }
  err = std::sqrt(err), norm = std::sqrt(norm);
  EXPECT_TRUE(err <= rel * norm) << what << ": ||got - ref|| = " << err << " exceeds " << rel << " ||ref|| = "
                                 << rel * norm;
}

// max |v| over the value slices of a host qkv (B, T, W).
double max_abs_v(const HostTensor& qkv, const TcCase& c) {
  const std::vector<double> x = values(qkv);
  double m = 0;
  const int64_t v0 = c.C() + c.KV * c.D;
  for (int64_t bt = 0; bt < c.B * c.T; ++bt)
    for (int64_t j = v0; j < c.W(); ++j) m = std::max(m, std::fabs(x[size_t(bt * c.W() + j)]));
  return m;
}

class CudaAttentionTcTest : public CudaTest, public ::testing::WithParamInterface<DType> {
 protected:
  // Forward and backward of one case on the tensor-core launchers against
  // the CPU flash pair in f64; the backward reference takes the GPU's own
  // rounded out, as the GPU backward does.
  void check_case(const TcCase& c, uint64_t seed) {
    const DType S = GetParam();
    const double u = unit_roundoff(S);
    const int64_t C = c.C(), W = c.W(), H = c.H, KV = c.KV;
    ASSERT_EQ(flash_attention_path(Device::CUDA, S, c.D), AttentionPath::TensorCores) << c.str();
    HostTensor qkv = random_host({c.B, c.T, W}, S, seed, c.scale);
    HostTensor dout = random_host({c.B, c.T, C}, S, seed + 1);
    HostTensor qkv64 = host_cast(qkv, DType::F64);

    HostTensor out_ref({c.B, c.T, C}, DType::F64), lse_ref({c.B, H, c.T}, DType::F64);
    flash_attention_forward(cpu(), out_ref, lse_ref, qkv64, int(H), int(KV));

    DeviceTensor qkv_dev = to_device(qkv), dout_dev = to_device(dout);
    DeviceTensor out({c.B, c.T, C}, S), lse({c.B, H, c.T}, DType::F32);
    cuda::flash_attention_forward_tc(ctx(), out, lse, qkv_dev, int(H), int(KV));
    const double s2 = c.scale * c.scale;
    const double out_atol = (u + double(c.T) * std::ldexp(1.0, -25)) * max_abs_v(qkv, c) + 5e-5 * s2;
    const HostTensor out_host = to_host(out);
    expect_close(out_host, out_ref, out_atol, u + 1e-5, "out " + c.str());
    expect_norm_close(out_host, out_ref, 2 * u + 1e-5, "out " + c.str());
    expect_close(to_host(lse), lse_ref, 5e-5 * s2 + 5e-5, 1e-6, "lse " + c.str());

    // dqkv starts as NaN (a fresh DeviceTensor): an element no kernel writes fails.
    DeviceTensor dqkv({c.B, c.T, W}, S);
    cuda::flash_attention_backward_tc(ctx(), dqkv, dout_dev, qkv_dev, out, lse, int(H), int(KV));
    HostTensor dqkv_ref({c.B, c.T, W}, DType::F64);
    flash_attention_backward(cpu(), dqkv_ref, host_cast(dout, DType::F64), qkv64, host_cast(out_host, DType::F64),
                             lse_ref, int(H), int(KV));
    const HostTensor dqkv_host = to_host(dqkv);
    expect_close(dqkv_host, dqkv_ref, 6 * u * scale_of(dqkv_ref), u + 1e-5, "dqkv " + c.str());
    expect_norm_close(dqkv_host, dqkv_ref, 2 * u + 1e-5, "dqkv " + c.str());

    // No atomics: a second run agrees bit for bit.
    DeviceTensor dqkv2({c.B, c.T, W}, S);
    cuda::flash_attention_backward_tc(ctx(), dqkv2, dout_dev, qkv_dev, out, lse, int(H), int(KV));
    expect_equal(to_host(dqkv2), dqkv_host, "dqkv reproducible " + c.str());
  }
};

INSTANTIATE_TEST_SUITE_P(Storage, CudaAttentionTcTest, ::testing::Values(DType::BF16, DType::F16),
                         ::xirang::test::dtype_param_name);

TEST_P(CudaAttentionTcTest, ForwardAndBackward) {
  uint64_t seed = 1200;
  for (const TcCase& c : tc_cases()) {
    check_case(c, seed);
    seed += 2;
  }
}

// Short sequences the cases above miss: one token, less than a tile, and
// whole tiles with two batch rows (T = 64, 128), multi-head and GQA. Small
// enough for compute-sanitizer's memcheck and racecheck (tools/gpu_check.sh
// runs them on this test, not on the long ones).
TEST_P(CudaAttentionTcTest, ShortSequences) {
  uint64_t seed = 1400;
  for (int64_t D : {64, 128})
    for (int64_t T : {1, 33, 64, 128}) {
      check_case({2, T, 4, 4, D, 1.0}, seed++);
      check_case({2, T, 8, 2, D, 1.0}, seed++);
    }
}

// T = 8192: 128 key tiles per row, so the online softmax and the float
// sums run long. B 1, H 2, D 64 keeps the CPU f64 reference at seconds.
TEST_P(CudaAttentionTcTest, LongSequence) { check_case({1, 8192, 2, 2, 64, 1.0}, 1300); }

// The public CUDA entry points run the tensor-core kernels for bf16 and f16
// with a supported head dim (bit for bit the same as calling them), else the
// fp32 ones.
TEST_P(CudaAttentionTcTest, EntryPointsDispatchByPath) {
  const DType S = GetParam();
  const int64_t B = 1, T = 100, H = 2, D = 64, C = H * D;
  HostTensor qkv = random_host({B, T, 3 * C}, S, 1400), dout = random_host({B, T, C}, S, 1401);
  DeviceTensor qkv_dev = to_device(qkv), dout_dev = to_device(dout);
  DeviceTensor out1({B, T, C}, S), lse1({B, H, T}, DType::F32), d1({B, T, 3 * C}, S);
  DeviceTensor out2({B, T, C}, S), lse2({B, H, T}, DType::F32), d2({B, T, 3 * C}, S);
  cuda::flash_attention_forward(ctx(), out1, lse1, qkv_dev, int(H));
  cuda::flash_attention_backward(ctx(), d1, dout_dev, qkv_dev, out1, lse1, int(H));
  cuda::flash_attention_forward_tc(ctx(), out2, lse2, qkv_dev, int(H));
  cuda::flash_attention_backward_tc(ctx(), d2, dout_dev, qkv_dev, out2, lse2, int(H));
  expect_equal(to_host(out1), to_host(out2), "out");
  expect_equal(to_host(lse1), to_host(lse2), "lse");
  expect_equal(to_host(d1), to_host(d2), "dqkv");

  // Head dim 40 has no tensor-core kernel: the entry point runs the fp32 one.
  const int64_t D2 = 40, C2 = H * D2;
  HostTensor qkv40 = random_host({B, T, 3 * C2}, S, 1402);
  DeviceTensor qkv40_dev = to_device(qkv40);
  DeviceTensor out3({B, T, C2}, S), lse3({B, H, T}, DType::F32), out4({B, T, C2}, S), lse4({B, H, T}, DType::F32);
  cuda::flash_attention_forward(ctx(), out3, lse3, qkv40_dev, int(H));
  cuda::flash_attention_forward_fp32(ctx(), out4, lse4, qkv40_dev, int(H));
  expect_equal(to_host(out3), to_host(out4), "out, head dim 40");
}

// The rule itself needs no GPU.
TEST(AttentionPathTest, PicksTensorCoresForHalfPrecision) {
  EXPECT_EQ(flash_attention_path(Device::CUDA, DType::BF16, 64), AttentionPath::TensorCores);
  EXPECT_EQ(flash_attention_path(Device::CUDA, DType::F16, 128), AttentionPath::TensorCores);
  EXPECT_EQ(flash_attention_path(Device::CUDA, DType::BF16, 32), AttentionPath::TensorCores);
  EXPECT_EQ(flash_attention_path(Device::CUDA, DType::BF16, 96), AttentionPath::TensorCores);
  EXPECT_EQ(flash_attention_path(Device::CUDA, DType::F32, 64), AttentionPath::CudaCores);
  EXPECT_EQ(flash_attention_path(Device::CUDA, DType::BF16, 40), AttentionPath::CudaCores);
  EXPECT_EQ(flash_attention_path(Device::CUDA, DType::F16, 256), AttentionPath::CudaCores);
  EXPECT_EQ(flash_attention_path(Device::CPU, DType::BF16, 64), AttentionPath::Cpu);
  EXPECT_EQ(flash_attention_path_name(Device::CUDA, DType::BF16, 64), "tensor cores (bf16, head dim 64)");
  EXPECT_EQ(flash_attention_path_name(Device::CUDA, DType::F32, 64), "fp32 CUDA cores (f32, head dim 64)");
  EXPECT_EQ(flash_attention_path_name(Device::CPU, DType::F32, 64), "CPU (f32, head dim 64)");
}

}  // namespace
}  // namespace xirang::test
