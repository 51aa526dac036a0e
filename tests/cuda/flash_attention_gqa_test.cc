// CUDA grouped-query flash attention, the fp32 CUDA-core kernels (n_head
// query heads sharing n_kv_head key/value heads), against the CPU flash
// pair in f64 on the same rounded inputs, for every storage dtype; the CPU
// pair is itself checked against a float64 expanded-heads reference in
// tests/kernels/flash_attention_gqa_test.cc.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|, as in
// attention_test.cc: out and lse atol 5e-5 s^2 (s the input scale), out rtol
// u_S + 1e-5, lse rtol 1e-6. dqkv against the CPU backward on the CUDA
// forward's own (rounded) out: float sums over up to T = 130 keys or
// queries, and for dk, dv over a group of up to 8 query heads (8 more float
// additions of terms of the same scale), relative ~1e-5 of the gradient's
// scale g: atol 4e-5 g, rtol u_S + 1e-5. A wrong key/value head, group sum
// or tile edge is off by a sizeable fraction of the scale.
#include <cstdint>
#include <functional>
#include <string>

#include "kernels/attention.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

using GqaCase = AttentionCase;

// Groups of 2, 3, 4 and 8 and multi-query; T = 70, 130, 45, 67 end in a
// partial 64-row tile; D = 40 is padded to 64; T = 1 is a single row;
// scale 3 makes the online rescaling matter.
const GqaCase kCases[] = {{2, 70, 4, 2, 16, 1.0}, {1, 130, 4, 1, 64, 1.0}, {2, 45, 6, 2, 40, 1.0},
                          {1, 67, 2, 1, 128, 1.0}, {3, 1, 4, 2, 32, 1.0},  {1, 100, 8, 1, 64, 3.0},
                          {2, 64, 8, 4, 32, 1.0}};

class CudaFlashGqaTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaFlashGqaTest);

TEST_P(CudaFlashGqaTest, ForwardAndBackward) {
  const DType S = GetParam();
  const double u = unit_roundoff(S);
  for (const GqaCase& c : kCases) {
    const int64_t C = c.C(), W = c.W(), H = c.H, KV = c.KV;
    HostTensor qkv = random_host({c.B, c.T, W}, S, 900 + uint64_t(c.T + W), c.scale);
    HostTensor dout = random_host({c.B, c.T, C}, S, 901);
    HostTensor qkv64 = host_cast(qkv, DType::F64);

    HostTensor out_ref({c.B, c.T, C}, DType::F64), lse_ref({c.B, H, c.T}, DType::F64);
    flash_attention_forward(cpu(), out_ref, lse_ref, qkv64, int(H), int(KV));

    DeviceTensor qkv_dev = to_device(qkv), dout_dev = to_device(dout);
    DeviceTensor out({c.B, c.T, C}, S), lse({c.B, H, c.T}, DType::F32);
    cuda::flash_attention_forward_fp32(ctx(), out, lse, qkv_dev, int(H), int(KV));
    const double atol = 5e-5 * c.scale * c.scale;
    expect_close(to_host(out), out_ref, atol, u + 1e-5, "out " + c.str());
    expect_close(to_host(lse), lse_ref, atol, 1e-6, "lse " + c.str());

    // dqkv starts as NaN (a fresh DeviceTensor): an element no kernel writes fails.
    DeviceTensor dqkv({c.B, c.T, W}, S);
    cuda::flash_attention_backward_fp32(ctx(), dqkv, dout_dev, qkv_dev, out, lse, int(H), int(KV));
    HostTensor dqkv_ref({c.B, c.T, W}, DType::F64);
    flash_attention_backward(cpu(), dqkv_ref, host_cast(dout, DType::F64), qkv64, host_cast(to_host(out), DType::F64),
                             lse_ref, int(H), int(KV));
    expect_close(to_host(dqkv), dqkv_ref, 4e-5 * scale_of(dqkv_ref), u + 1e-5, "dqkv " + c.str());

    // No atomics: a second run agrees bit for bit.
    DeviceTensor dqkv2({c.B, c.T, W}, S);
    cuda::flash_attention_backward_fp32(ctx(), dqkv2, dout_dev, qkv_dev, out, lse, int(H), int(KV));
    expect_equal(to_host(dqkv2), to_host(dqkv), "dqkv reproducible " + c.str());
  }
}

// n_kv_head = n_head gives the bytes of the multi-head call.
TEST_P(CudaFlashGqaTest, KvEqualToHeadsIsTheDefault) {
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
TEST(CudaFlashGqaChecks, RejectsBadHeadCounts) {
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
  expect_shape_error(
      [&] {
        cuda::flash_attention_forward(ctx, dev({1, 4, 24}, DType::F32), dev({1, 6, 4}, DType::F32),
                                      dev({1, 4, 56}, DType::F32), 6, 4);
      },
      "n_head 6 is not a positive multiple of n_kv_head 4");
  expect_shape_error(
      [&] {
        cuda::flash_attention_backward(ctx, dev({1, 4, 50}, DType::F32), dev({1, 4, 16}, DType::F32),
                                       dev({1, 4, 50}, DType::F32), dev({1, 4, 16}, DType::F32),
                                       dev({1, 4, 4}, DType::F32), 4, 2);
      },
      "(n_head + 2 n_kv_head) head_dim");
}

}  // namespace
}  // namespace xirang::test
