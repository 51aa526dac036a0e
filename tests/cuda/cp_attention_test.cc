// CUDA context-parallel attention (kernels/cp_attention.h), kv_pack and
// kv_unpack, and the context-parallel position overloads (add_positions,
// rope_qkv) against the CPU ops in f64 on the same rounded inputs, for every
// storage dtype, both splits and every rank.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|, with s the
// largest reference magnitude (at least 1):
// - attention: the device computes in float (online softmax forward, dot
//   products over D <= 64 lanes, sums over <= 64 keys): ~1e-6 relative per
//   value, so atol 2e-5 s; 16-bit outputs are rounded once: rtol u and,
//   because backward reads the stored out for delta = dO . O, atol adds 4u s
//   for the gradients (the CPU 16-bit analysis, tests/kernels/flash_attention_test.cc).
// - lse is f32 everywhere: atol 2e-5 s.
// - copies (kv_pack, kv_unpack) and the backward's repeat run: exact.
// - positions: add_positions is one float add rounded once (rtol u + 1e-7);
//   rope as tests/cuda/rope_test.cc (atol 2e-6, rtol u + 1e-6).
#include <string>
#include <vector>

#include "kernels/context_split.h"
#include "kernels/cp_attention.h"
#include "kernels/cuda/ops.h"
#include "kernels/embedding.h"
#include "kernels/rope.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

struct Case {
  int64_t B, L, H, KV, D;
  int c;
  bool head_tail;
};
const std::vector<Case> kCases = {{2, 7, 4, 2, 16, 2, true}, {1, 9, 4, 1, 64, 4, false}, {2, 5, 4, 4, 8, 4, true}};

class CudaCpAttentionTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaCpAttentionTest);

TEST_P(CudaCpAttentionTest, EveryRankMatchesCpu) {
  const DType S = GetParam();
  const double u = unit_roundoff(S);
  for (const Case& c : kCases) {
    const ContextSplit split = ContextSplit::of(2 * c.c * c.L, c.c, c.head_tail);
    const int64_t Tl = split.local_rows(), W = (c.H + 2 * c.KV) * c.D, K = 2 * c.KV * c.D, C = c.H * c.D;
    HostTensor kv_all = random_host({c.c, c.B, Tl, K}, S, 3001);
    const HostTensor kv_all64 = host_cast(kv_all, DType::F64);
    DeviceTensor kv_all_d = to_device(kv_all);
    for (int r = 0; r < c.c; ++r) {
      const std::string what = "c " + std::to_string(c.c) + " D " + std::to_string(c.D) + " rank " + std::to_string(r);
      HostTensor qkv = random_host({c.B, Tl, W}, S, 3002 + r), dout = random_host({c.B, Tl, C}, S, 3003 + r);
      HostTensor dq0 = random_host({c.B, Tl, W}, S, 3004 + r);
      // CPU in f64.
      const HostTensor qkv64 = host_cast(qkv, DType::F64), dout64 = host_cast(dout, DType::F64);
      HostTensor out64({c.B, Tl, C}, DType::F64), lse64({c.B, c.H, Tl}, DType::F64);
      HostTensor dq64 = host_cast(dq0, DType::F64), dkv64({c.c, c.B, Tl, K}, DType::F64);
      cp_attention_forward(cpu(), out64, lse64, qkv64, kv_all64, split, r, int(c.H), int(c.KV));
      cp_attention_backward(cpu(), dq64, dkv64, dout64, qkv64, kv_all64, out64, lse64, split, r, int(c.H),
                            int(c.KV));
      // CUDA in S; backward reads the device's own out and lse.
      DeviceTensor q = to_device(qkv), dO = to_device(dout), out({c.B, Tl, C}, S), lse({c.B, c.H, Tl}, DType::F32);
      DeviceTensor dq = to_device(dq0), dkv({c.c, c.B, Tl, K}, S);
      cuda::cp_attention_forward(ctx(), out, lse, q, kv_all_d, split, r, int(c.H), int(c.KV));
      cuda::cp_attention_backward(ctx(), dq, dkv, dO, q, kv_all_d, out, lse, split, r, int(c.H), int(c.KV));
      const double so = std::max(1.0, scale_of(out64)), sq = std::max(1.0, scale_of(dq64));
      const double sk = std::max(1.0, scale_of(dkv64));
      expect_close(to_host(out), out64, 2e-5 * so, u, what + " out");
      expect_close(to_host(lse), lse64, 2e-5 * std::max(1.0, scale_of(lse64)), 0, what + " lse");
      expect_close(to_host(dq), dq64, (2e-5 + 4 * u) * sq, u, what + " dqkv");
      expect_close(to_host(dkv), dkv64, (2e-5 + 4 * u) * sk, u, what + " dkv_all");
      // No atomics: a second backward repeats bit for bit.
      DeviceTensor dq2 = to_device(dq0), dkv2({c.c, c.B, Tl, K}, S);
      cuda::cp_attention_backward(ctx(), dq2, dkv2, dO, q, kv_all_d, out, lse, split, r, int(c.H), int(c.KV));
      expect_equal(to_host(dq2), to_host(dq), what + " dqkv repeat");
      expect_equal(to_host(dkv2), to_host(dkv), what + " dkv_all repeat");
    }
  }
}

TEST_P(CudaCpAttentionTest, PackAndUnpackMatchCpu) {
  const DType S = GetParam();
  const int64_t B = 2, T = 5, H = 4, KV = 2, D = 8, W = (H + 2 * KV) * D, K = 2 * KV * D;
  HostTensor qkv = random_host({B, T, W}, S, 3101), dq0 = random_host({B, T, W}, S, 3102);
  HostTensor kv({B, T, K}, S);
  kv_pack(cpu(), kv, qkv, int(H), int(KV));
  DeviceTensor kv_d({B, T, K}, S), qkv_d = to_device(qkv);
  cuda::kv_pack(ctx(), kv_d, qkv_d, int(H), int(KV));
  expect_equal(to_host(kv_d), kv, "kv_pack");
  HostTensor dq = host_cast(dq0, S);
  kv_unpack(cpu(), dq, kv, int(H), int(KV));
  DeviceTensor dq_d = to_device(dq0);
  cuda::kv_unpack(ctx(), dq_d, kv_d, int(H), int(KV));
  expect_equal(to_host(dq_d), dq, "kv_unpack");
}

TEST_P(CudaCpAttentionTest, PositionOverloadsMatchCpu) {
  const DType S = GetParam();
  const double u = unit_roundoff(S);
  const DType G = DType::F32;  // dwpe: f32 (allowed beside every CUDA storage type)
  for (const ContextSplit& split : {ContextSplit::of(24, 2), ContextSplit::of(24, 4, false)}) {
    const int64_t B = 2, Tl = split.local_rows(), C = 12, N = B * Tl - 3, off = 2;
    HostTensor wpe = random_host({26, C}, S, 3201), x = random_host({N, C}, S, 3202);
    HostTensor dwpe0 = random_host({26, C}, G, 3203);
    for (int r = 0; r < split.ranks; ++r) {
      const std::string what = "c " + std::to_string(split.ranks) + " rank " + std::to_string(r);
      HostTensor ref = host_cast(x, DType::F64);
      add_positions(cpu(), ref, host_cast(wpe, DType::F64), split, r, off);
      DeviceTensor xd = to_device(x);
      cuda::add_positions(ctx(), xd, to_device(wpe), split, r, off);
      expect_close(to_host(xd), ref, 0, u + 1e-7, what + " add_positions");
      HostTensor dref = host_cast(dwpe0, DType::F64);
      add_positions_backward(cpu(), dref, host_cast(x, DType::F64), split, r, off);
      DeviceTensor dd = to_device(dwpe0);
      cuda::add_positions_backward(ctx(), dd, to_device(x), split, r, off);
      expect_close(to_host(dd), dref, 1e-6, 1e-6, what + " add_positions_backward");
      // rope on the rank's packed rows
      const int64_t H = 2, KV = 1, D = 16, W = (H + 2 * KV) * D;
      HostTensor cos64({26, D / 2}, DType::F64), sin64({26, D / 2}, DType::F64);
      rope_table(cpu(), cos64, sin64, RopeConfig{});
      DeviceTensor cos({26, D / 2}, DType::F32), sin({26, D / 2}, DType::F32);
      cuda::rope_table(ctx(), cos, sin, RopeConfig{});
      HostTensor q = random_host({B, Tl, W}, S, 3204 + r);
      for (bool backward : {false, true}) {
        HostTensor qref = host_cast(q, DType::F64);
        DeviceTensor qd = to_device(q);
        if (backward) {
          rope_qkv_backward(cpu(), qref, cos64, sin64, int(H), int(KV), split, r);
          cuda::rope_qkv_backward(ctx(), qd, cos, sin, int(H), int(KV), split, r);
        } else {
          rope_qkv_forward(cpu(), qref, cos64, sin64, int(H), int(KV), split, r);
          cuda::rope_qkv_forward(ctx(), qd, cos, sin, int(H), int(KV), split, r);
        }
        expect_close(to_host(qd), qref, 2e-6, u + 1e-6, what + (backward ? " rope backward" : " rope forward"));
      }
    }
  }
}

}  // namespace
}  // namespace xirang::test
