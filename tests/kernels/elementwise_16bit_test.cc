// Tests for kernels/elementwise.h with BF16 and F16 storage: GELU forward and
// backward, add, add_bias and scale, against the float64 reference on
// inputs rounded to the 16-bit type first.
//
// Each output element is computed in float from exact 16-bit inputs (GELU:
// a few ulp of float, ~1e-7 relative; the adds are exact in float for these
// magnitudes) and rounded once, so it is within u |y| of the reference, u =
// 2^-8 (bf16) or 2^-11 (f16). The tolerance is 2u of the max(1, max|ref|)
// scale, and >= 97% of the elements (99% for the exact adds) must equal the
// reference rounded once; an op that rounded an intermediate (x^3, tanh) to
// 16 bits would miss both.
#include <cmath>

#include "kernels/elementwise.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

template <class S>
class Elementwise16Test : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, C = 48;
  static constexpr double kTol = 2 * unit_roundoff<S>();
  KernelContext ctx;
  std::vector<S> x = cast_vec<S>(randn(N * C, 1201, 2.0));
  std::vector<S> dy = cast_vec<S>(randn(N * C, 1202));
};
using Storage16 = ::testing::Types<bf16, f16>;
TYPED_TEST_SUITE(Elementwise16Test, Storage16);

TYPED_TEST(Elementwise16Test, GeluForward) {
  using S = TypeParam;
  auto& f = *this;
  auto y = cast_vec<S>(randn(f.N * f.C, 1203));
  gelu_forward(f.ctx, view(y, {f.N, f.C}), view(f.x, {f.N, f.C}));
  Vec xr = to_f64(f.x), ref(xr.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = ref_gelu(xr[i]);
  expect_near(y, ref, f.kTol, "gelu y");
  expect_mostly_rounded(y, ref, 0.97, "gelu y");
}

// Out of place and in place (dx over dy, as the MLP backward does).
TYPED_TEST(Elementwise16Test, GeluBackward) {
  using S = TypeParam;
  auto& f = *this;
  Vec xr = to_f64(f.x), dyr = to_f64(f.dy), ref(xr.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = dyr[i] * ref_gelu_grad(xr[i]);
  auto dx = cast_vec<S>(randn(f.N * f.C, 1204));
  gelu_backward(f.ctx, view(dx, {f.N, f.C}), view(f.dy, {f.N, f.C}), view(f.x, {f.N, f.C}));
  expect_near(dx, ref, f.kTol, "gelu dx");
  expect_mostly_rounded(dx, ref, 0.97, "gelu dx");
  Tensor d = view(f.dy, {f.N, f.C});
  gelu_backward(f.ctx, d, d, view(f.x, {f.N, f.C}));
  EXPECT_EQ(bytes_of(f.dy), bytes_of(dx)) << "in place differs from out of place";
}

TYPED_TEST(Elementwise16Test, AddBiasAndScale) {
  using S = TypeParam;
  auto& f = *this;
  Vec ref = plus(to_f64(f.x), to_f64(f.dy));
  auto out = cast_vec<S>(randn(f.N * f.C, 1205));
  add(f.ctx, view(out, {f.N, f.C}), view(f.x, {f.N, f.C}), view(f.dy, {f.N, f.C}));
  expect_near(out, ref, f.kTol, "add");
  expect_mostly_rounded(out, ref, 0.99, "add");
  auto a = f.x;  // out aliasing a: the residual stream
  add(f.ctx, view(a, {f.N, f.C}), view(a, {f.N, f.C}), view(f.dy, {f.N, f.C}));
  EXPECT_EQ(bytes_of(a), bytes_of(out)) << "add in place";

  auto bias = cast_vec<S>(randn(f.C, 1206));
  auto y = f.x;
  add_bias(f.ctx, view(y, {f.N, f.C}), view(bias, {f.C}));
  Vec ref_b = ref_add_bias(to_f64(f.x), to_f64(bias), f.N, f.C);
  expect_near(y, ref_b, f.kTol, "add_bias");
  expect_mostly_rounded(y, ref_b, 0.99, "add_bias");

  const double s = -0.3719;
  auto z = f.x;
  scale(f.ctx, view(z, {f.N, f.C}), s);
  Vec ref_s = to_f64(f.x);
  for (double& v : ref_s) v *= s;
  expect_near(z, ref_s, f.kTol, "scale");
  expect_mostly_rounded(z, ref_s, 0.99, "scale");
}

// cast() from f64 rounds once: a double just above a bf16 tie (by 2^-40,
// far below float's precision) must round up, where rounding to float first
// would land on the tie and round to even (down).
TEST(Cast16, DoubleToBf16RoundsOnce) {
  KernelContext ctx;
  std::vector<double> in = {1.0 + 0x1p-8 + 0x1p-40, -(1.0 + 0x1p-8 + 0x1p-40), 1.0 + 0x1p-11 + 0x1p-40};
  std::vector<bf16> out(2);
  cast(ctx, Tensor(out.data(), {2}, DType::BF16), Tensor(in.data(), {2}, DType::F64));
  EXPECT_EQ(bf16_to_float(out[0]), 1.0f + 0x1p-7f);
  EXPECT_EQ(bf16_to_float(out[1]), -(1.0f + 0x1p-7f));
  std::vector<f16> h(1);
  cast(ctx, Tensor(h.data(), {1}, DType::F16), Tensor(in.data() + 2, {1}, DType::F64));
  EXPECT_EQ(f16_to_float(h[0]), 1.0f + 0x1p-10f);
}

}  // namespace
}  // namespace xirang::test
