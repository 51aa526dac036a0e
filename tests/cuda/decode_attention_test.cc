// CUDA decode attention (kernels/decode_attention.h) against the CPU op in
// f64 on the same rounded inputs, for every storage dtype: a prefill, then
// single tokens, then a chunk, multi-head and grouped-query, with the caches
// compared too (they must hold the inputs exactly). The CPU op is checked
// against a float64 reference and the flash forward in
// tests/kernels/decode_attention_test.cc.
//
// Tolerances: out atol 5e-5, rtol u_S + 1e-5, as the flash attention tests
// (float scores, exponentials and sums over up to 70 keys; one rounding to S).
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/decode_attention.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

struct DecodeCase {
  int64_t B, H, KV, D, T_max;
  std::vector<int64_t> chunks;  // new tokens per call
  std::string str() const {
    return "B " + std::to_string(B) + " H " + std::to_string(H) + " KV " + std::to_string(KV) + " D " +
           std::to_string(D) + " T_max " + std::to_string(T_max);
  }
};

const DecodeCase kCases[] = {{2, 4, 4, 16, 40, {30, 1, 1, 5}},
                             {1, 8, 2, 64, 70, {64, 1, 1, 1}},
                             {3, 6, 3, 40, 20, {1, 1, 1, 17}},
                             {1, 4, 1, 128, 300, {257, 1, 1}}};

// Rows [pos, pos + n) of a host (B, T, W) tensor.
HostTensor rows(const Tensor& x, int64_t pos, int64_t n) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), e = int64_t(dtype_size(x.dtype()));
  HostTensor r({B, n, W}, x.dtype());
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(static_cast<char*>(r.tensor().raw()) + b * n * W * e,
                static_cast<const char*>(x.raw()) + (b * T + pos) * W * e, size_t(n * W * e));
  return r;
}

class CudaDecodeAttentionTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaDecodeAttentionTest);

TEST_P(CudaDecodeAttentionTest, MatchesCpu) {
  const DType S = GetParam();
  for (const DecodeCase& c : kCases) {
    int64_t T = 0;
    for (int64_t n : c.chunks) T += n;
    const int64_t W = (c.H + 2 * c.KV) * c.D, C = c.H * c.D, KVD = c.KV * c.D;
    HostTensor qkv = random_host({c.B, T, W}, S, 40 + uint64_t(W), 1.5);
    HostTensor qkv64 = host_cast(qkv, DType::F64);
    HostTensor kc64({c.B, c.T_max, KVD}, DType::F64), vc64({c.B, c.T_max, KVD}, DType::F64);
    DeviceTensor kc({c.B, c.T_max, KVD}, S), vc({c.B, c.T_max, KVD}, S);
    int64_t pos = 0;
    for (int64_t n : c.chunks) {
      HostTensor in = rows(qkv, pos, n), in64 = rows(qkv64, pos, n);
      HostTensor ref({c.B, n, C}, DType::F64);
      decode_attention_forward(cpu(), ref, kc64, vc64, in64, pos, int(c.H), int(c.KV));
      DeviceTensor in_dev = to_device(in), out({c.B, n, C}, S);
      cuda::decode_attention_forward(ctx(), out, kc, vc, in_dev, pos, int(c.H), int(c.KV));
      const std::string what = c.str() + " S " + dtype_name(S) + " pos " + std::to_string(pos) + " n " +
                               std::to_string(n);
      expect_close(to_host(out), ref, 5e-5, unit_roundoff(S) + 1e-5, "decode out, " + what);
      pos += n;
    }
    // The caches' filled positions hold the inputs exactly.
    const std::vector<double> k = values(to_host(kc)), v = values(to_host(vc)), k64 = values(kc64),
                              v64 = values(vc64);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t i = b * c.T_max * KVD; i < (b * c.T_max + T) * KVD; ++i) {
        ASSERT_EQ(k[size_t(i)], k64[size_t(i)]) << "k cache element " << i << ", " << c.str();
        ASSERT_EQ(v[size_t(i)], v64[size_t(i)]) << "v cache element " << i << ", " << c.str();
      }
  }
}

}  // namespace
}  // namespace xirang::test
