// CUDA rotary embeddings (table, rotation of plain and packed q/k, forward
// and backward) against the CPU ops in f64 on the same rounded inputs, for
// every storage dtype.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|:
// - Table: the device computes each entry in double (sincos) and rounds it
//   once to f32, as the CPU does; against the CPU's f64 table the error is
//   that one rounding, <= 2^-24 for values in [-1, 1] (a device sincos one
//   double ulp off can only move a value across a rounding boundary, still
//   within one f32 ulp): atol 2^-24 (1.01x).
// - Rotation: x1 c - x2 s in float (possibly fused) with f32 table entries
//   (2^-24 each) on |x| <= ~6: ~1e-6 absolute at most: atol 2e-6;
//   rtol = u_S + 1e-6 for the rounded store. The reference is the CPU op in
//   f64 with the f64 table, so a table error on the device shows too.
// A wrong sign, pairing, frequency or position is off by O(1).
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/rope.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

const RopeConfig kLlama31{500000.0, RopeScaling::llama3(8.0, 1.0, 4.0, 8192.0)};

struct Case {
  int64_t B, T, H, KV, D, pos_offset;
};
// The 8B model's head (D 128, 4 q heads and 2 kv heads of a tensor-parallel
// rank) from position 0 and after a cache of 100 tokens, and a small head
// with odd row counts.
const std::vector<Case> kCases = {{2, 33, 4, 2, 128, 0}, {1, 5, 4, 2, 128, 100}, {3, 7, 3, 1, 16, 9}};
constexpr int64_t kTMax = 160;

class CudaRopeTest : public CudaDTypeTest {
 protected:
  // The CPU's f64 table and the device's f32 one for head dim D.
  void tables(int64_t D, HostTensor& cos64, HostTensor& sin64, DeviceTensor& cos, DeviceTensor& sin) {
    cos64 = HostTensor({kTMax, D / 2}, DType::F64);
    sin64 = HostTensor({kTMax, D / 2}, DType::F64);
    rope_table(cpu(), cos64, sin64, kLlama31);
    cos = DeviceTensor({kTMax, D / 2}, DType::F32);
    sin = DeviceTensor({kTMax, D / 2}, DType::F32);
    cuda::rope_table(ctx(), cos, sin, kLlama31);
  }
};
XR_INSTANTIATE_STORAGE_DTYPES(CudaRopeTest);

TEST_P(CudaRopeTest, Table) {
  for (int64_t D : {int64_t(16), int64_t(128)}) {
    HostTensor cos64, sin64;
    DeviceTensor cos, sin;
    tables(D, cos64, sin64, cos, sin);
    expect_close(to_host(cos), cos64, 1.01 * 0x1p-24, 0, "cos D " + std::to_string(D));
    expect_close(to_host(sin), sin64, 1.01 * 0x1p-24, 0, "sin D " + std::to_string(D));
  }
}

// Packed qkv and plain (all heads), forward and backward, in place.
TEST_P(CudaRopeTest, RotationMatchesCpu) {
  const DType S = GetParam();
  for (const Case& c : kCases) {
    HostTensor cos64, sin64;
    DeviceTensor cos, sin;
    tables(c.D, cos64, sin64, cos, sin);
    const int64_t W = (c.H + 2 * c.KV) * c.D;
    const Shape shape{c.B, c.T, W};
    const std::string what = "D " + std::to_string(c.D) + " offset " + std::to_string(c.pos_offset);
    HostTensor xh = random_host(shape, S, 600 + uint64_t(c.D), 1.5);
    for (int form = 0; form < 4; ++form) {
      const bool packed = form < 2, backward = form % 2 == 1;
      const std::string name = what + (packed ? " qkv" : " plain") + (backward ? " backward" : " forward");
      HostTensor ref = host_cast(xh, DType::F64);
      DeviceTensor x = to_device(xh);
      if (packed && !backward) {
        rope_qkv_forward(cpu(), ref, cos64, sin64, int(c.H), int(c.KV), c.T, c.pos_offset);
        cuda::rope_qkv_forward(ctx(), x, cos, sin, int(c.H), int(c.KV), c.T, c.pos_offset);
      } else if (packed) {
        rope_qkv_backward(cpu(), ref, cos64, sin64, int(c.H), int(c.KV), c.T, c.pos_offset);
        cuda::rope_qkv_backward(ctx(), x, cos, sin, int(c.H), int(c.KV), c.T, c.pos_offset);
      } else if (!backward) {
        rope_forward(cpu(), ref, cos64, sin64, c.T, c.pos_offset);
        cuda::rope_forward(ctx(), x, cos, sin, c.T, c.pos_offset);
      } else {
        rope_backward(cpu(), ref, cos64, sin64, c.T, c.pos_offset);
        cuda::rope_backward(ctx(), x, cos, sin, c.T, c.pos_offset);
      }
      HostTensor got = to_host(x);
      expect_close(got, ref, 2e-6, unit_roundoff(S) + 1e-6, name);
      if (packed) {
        // The v heads are left exactly as they were.
        const std::vector<double> g = values(got), x0 = values(xh);
        for (int64_t r = 0; r < c.B * c.T; ++r)
          for (int64_t j = (c.H + c.KV) * c.D; j < W; ++j)
            ASSERT_EQ(g[r * W + j], x0[r * W + j]) << name << ": v changed at row " << r;
      }
    }
  }
}

TEST(CudaRopeChecks, RefusesAWideHeadAndAnF64Table) {
  void* fake = reinterpret_cast<void*>(uintptr_t(4096));
  auto dev = [&](Shape s, DType t) { return Tensor(fake, s, t, Device::CUDA); };
  KernelContext ctx;
  ctx.device = Device::CUDA;
  expect_error([&] { cuda::rope_table(ctx, dev({8, 300}, DType::F32), dev({8, 300}, DType::F32), kLlama31); },
               ErrorKind::Shape, {"rope_table", "head_dim"});
  expect_error(
      [&] { cuda::rope_forward(ctx, dev({4, 16}, DType::F32), dev({8, 8}, DType::F64), dev({8, 8}, DType::F64), 4, 0); },
      ErrorKind::Shape, {"rope_forward", "cos"});
}

}  // namespace
}  // namespace xirang::test
