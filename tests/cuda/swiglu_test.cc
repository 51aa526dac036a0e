// CUDA SwiGLU, separate and packed, forward and backward, against the CPU
// ops in f64 on the same rounded inputs, for every storage dtype; the
// packed forms bitwise equal to the separate ones, and the in-place
// backward to the out-of-place one.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|: each output is
// a few float operations and one expf (<= 2 ulp) on |g| <= ~8, |u|, |dh|
// <= ~4: a few 1e-7 relative of values up to ~30, so atol 2e-6 and rtol =
// u_S + 2e-6 for the rounded store. A wrong derivative term is off by 1e-1.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/swiglu.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

// (N, F): odd sizes, and the 8B model's FFN width on one of 8 tensor-parallel ranks.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{13, 37}, {64, 1792}};

// [g | u] rows of width 2F from (N, F) halves.
HostTensor pack(const Tensor& g, const Tensor& u, int64_t N, int64_t F) {
  std::vector<double> gv = values(g), uv = values(u), out(size_t(N * 2 * F));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) {
      out[n * 2 * F + j] = gv[n * F + j];
      out[n * 2 * F + F + j] = uv[n * F + j];
    }
  return host_from(out, {N, 2 * F}, g.dtype());
}

class CudaSwigluTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaSwigluTest);

TEST_P(CudaSwigluTest, ForwardAndBackward) {
  const DType S = GetParam();
  const double atol = 2e-6, rtol = unit_roundoff(S) + 2e-6;
  for (auto [N, F] : kShapes) {
    const std::string what = Shape{N, F}.str();
    HostTensor gh = random_host({N, F}, S, 700 + uint64_t(F), 2.5), uh = random_host({N, F}, S, 701),
               dhh = random_host({N, F}, S, 702);
    HostTensor h_ref({N, F}, DType::F64), dg_ref({N, F}, DType::F64), du_ref({N, F}, DType::F64);
    HostTensor g64 = host_cast(gh, DType::F64), u64 = host_cast(uh, DType::F64), dh64 = host_cast(dhh, DType::F64);
    swiglu_forward(cpu(), h_ref, g64, u64);
    swiglu_backward(cpu(), dg_ref, du_ref, dh64, g64, u64);

    DeviceTensor g = to_device(gh), u = to_device(uh), dh = to_device(dhh);
    DeviceTensor h({N, F}, S), dg({N, F}, S), du({N, F}, S);
    cuda::swiglu_forward(ctx(), h, g, u);
    cuda::swiglu_backward(ctx(), dg, du, dh, g, u);
    HostTensor h_got = to_host(h), dg_got = to_host(dg), du_got = to_host(du);
    expect_close(h_got, h_ref, atol, rtol, what + " h");
    expect_close(dg_got, dg_ref, atol, rtol, what + " dg");
    expect_close(du_got, du_ref, atol, rtol, what + " du");

    // Packed: the same values bit for bit, out of place and over gu.
    HostTensor guh = pack(gh, uh, N, F);
    DeviceTensor gu = to_device(guh), hp({N, F}, S), dgu({N, 2 * F}, S);
    cuda::swiglu_packed_forward(ctx(), hp, gu);
    cuda::swiglu_packed_backward(ctx(), dgu, dh, gu);
    expect_equal(to_host(hp), h_got, what + " packed h");
    HostTensor dgu_want = pack(dg_got, du_got, N, F);
    expect_equal(to_host(dgu), dgu_want, what + " packed dgu");
    cuda::swiglu_packed_backward(ctx(), gu, dh, gu);
    expect_equal(to_host(gu), dgu_want, what + " packed dgu over gu");
    // Separate, in place over g and u.
    cuda::swiglu_backward(ctx(), g, u, dh, g, u);
    expect_equal(to_host(g), dg_got, what + " dg over g");
    expect_equal(to_host(u), du_got, what + " du over u");
  }
}

TEST(CudaSwigluChecks, PackedWidthMustBeEven) {
  void* fake = reinterpret_cast<void*>(uintptr_t(4096));
  auto dev = [&](Shape s, DType t) { return Tensor(fake, s, t, Device::CUDA); };
  KernelContext ctx;
  ctx.device = Device::CUDA;
  expect_error([&] { cuda::swiglu_packed_forward(ctx, dev({4, 3}, DType::BF16), dev({4, 7}, DType::BF16)); },
               ErrorKind::Shape, {"swiglu_packed_forward", "gu"});
}

}  // namespace
}  // namespace xirang::test
