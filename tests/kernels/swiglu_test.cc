// Tests for kernels/swiglu.h, separate and packed, against a float64
// reference written from the formula, in every storage dtype, with a
// finite-difference check of the float64 backward, the packed buffer's
// layout (including a tensor-parallel rank's [g_local | u_local]) and
// in-place backward.
//
// Tolerances, as max |got - ref| <= tol * max(1, max |ref|):
// - F32: 1e-6. Each output is a handful of float operations on unit-scale
//   inputs (|g|, |u| <= ~6 here) plus float exp: a few ulps of values up to
//   ~30, ~1e-6 of the unit scale at worst. A wrong derivative term is off by
//   1e-1 or more.
// - F64: 1e-10 (the same formula, evaluated in another order).
// - BF16/F16: 2u of the scale, and >= 97% of the elements equal to the
//   reference rounded once.
#include <cmath>

#include "kernels/swiglu.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-6;
constexpr double kMinRounded = 0.97;

double ref_silu(double g) { return g / (1.0 + std::exp(-g)); }
// d/dg [g sigma(g)] = sigma(g) + g sigma(g) (1 - sigma(g)).
double ref_silu_grad(double g) {
  const double s = 1.0 / (1.0 + std::exp(-g));
  return s + g * s * (1.0 - s);
}

Vec ref_swiglu(const Vec& g, const Vec& u) {
  Vec h(g.size());
  for (size_t i = 0; i < g.size(); ++i) h[i] = ref_silu(g[i]) * u[i];
  return h;
}

struct SwigluGrads {
  Vec dg, du;
};
SwigluGrads ref_swiglu_backward(const Vec& dh, const Vec& g, const Vec& u) {
  SwigluGrads r{Vec(g.size()), Vec(g.size())};
  for (size_t i = 0; i < g.size(); ++i) {
    r.dg[i] = dh[i] * u[i] * ref_silu_grad(g[i]);
    r.du[i] = dh[i] * ref_silu(g[i]);
  }
  return r;
}

// Rows [g | u] of width 2F from separate (N, F) g and u, and back.
Vec pack(const Vec& g, const Vec& u, int64_t N, int64_t F) {
  Vec gu(N * 2 * F);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) {
      gu[n * 2 * F + j] = g[n * F + j];
      gu[n * 2 * F + F + j] = u[n * F + j];
    }
  return gu;
}

template <class S>
double tolerance() {
  if constexpr (is_16bit_v<S>) return 2 * unit_roundoff<S>();
  else return tol<S>(kTolF32);
}

template <class S>
class SwigluTest : public ::testing::Test {
 protected:
  static constexpr int64_t N = 13, F = 37;
  KernelContext ctx;
  // g spans the sigmoid's whole range (scale 2.5: |g| up to ~8).
  const Vec g = rounded<S>(randn(N * F, 4101, 2.5));
  const Vec u = rounded<S>(randn(N * F, 4102));
  const Vec dh = rounded<S>(randn(N * F, 4103));
};
using AllStorage = ::testing::Types<float, double, bf16, f16>;
TYPED_TEST_SUITE(SwigluTest, AllStorage);

TYPED_TEST(SwigluTest, Forward) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, F = f.F;
  const Vec want = ref_swiglu(f.g, f.u);
  auto g = cast_vec<S>(f.g), u = cast_vec<S>(f.u);
  auto h = cast_vec<S>(randn(N * F, 4104));
  swiglu_forward(f.ctx, view(h, {N, F}), view(g, {N, F}), view(u, {N, F}));
  expect_near(h, want, tolerance<S>(), "h");
  if constexpr (is_16bit_v<S>) expect_mostly_rounded(h, want, kMinRounded, "h");
  // Packed: bitwise the separate result.
  auto gu = cast_vec<S>(pack(f.g, f.u, N, F));
  auto hp = cast_vec<S>(randn(N * F, 4105));
  swiglu_packed_forward(f.ctx, view(hp, {N, F}), view(gu, {N, 2 * F}));
  EXPECT_EQ(bytes_of(hp), bytes_of(h)) << "packed h";
}

TYPED_TEST(SwigluTest, Backward) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, F = f.F;
  const SwigluGrads want = ref_swiglu_backward(f.dh, f.g, f.u);
  auto g = cast_vec<S>(f.g), u = cast_vec<S>(f.u), dh = cast_vec<S>(f.dh);
  auto dg = cast_vec<S>(randn(N * F, 4111)), du = cast_vec<S>(randn(N * F, 4112));
  swiglu_backward(f.ctx, view(dg, {N, F}), view(du, {N, F}), view(dh, {N, F}), view(g, {N, F}), view(u, {N, F}));
  expect_near(dg, want.dg, tolerance<S>(), "dg");
  expect_near(du, want.du, tolerance<S>(), "du");
  if constexpr (is_16bit_v<S>) {
    expect_mostly_rounded(dg, want.dg, kMinRounded, "dg");
    expect_mostly_rounded(du, want.du, kMinRounded, "du");
  }
  // Packed, into a separate buffer and in place over gu: bitwise [dg | du].
  const auto want_packed = cast_vec<S>(pack(to_f64(dg), to_f64(du), N, F));
  auto gu = cast_vec<S>(pack(f.g, f.u, N, F));
  auto dgu = cast_vec<S>(randn(N * 2 * F, 4113));
  swiglu_packed_backward(f.ctx, view(dgu, {N, 2 * F}), view(dh, {N, F}), view(gu, {N, 2 * F}));
  EXPECT_EQ(bytes_of(dgu), bytes_of(want_packed)) << "packed dgu";
  swiglu_packed_backward(f.ctx, view(gu, {N, 2 * F}), view(dh, {N, F}), view(gu, {N, 2 * F}));
  EXPECT_EQ(bytes_of(gu), bytes_of(want_packed)) << "packed dgu in place over gu";
  // Separate, in place over g and u.
  swiglu_backward(f.ctx, view(g, {N, F}), view(u, {N, F}), view(dh, {N, F}), view(g, {N, F}), view(u, {N, F}));
  EXPECT_EQ(bytes_of(g), bytes_of(dg)) << "dg in place over g";
  EXPECT_EQ(bytes_of(u), bytes_of(du)) << "du in place over u";
}

// The layout a tensor-parallel rank holds. With the full gate/up weights
// stacked per rank ([Wg_0; Wu_0; Wg_1; Wu_1], rank r owning rows
// [r F/2, (r+1) F/2) of Wg and of Wu), rank r's matmul output is
// [g[:, block r] | u[:, block r]], and its h is column block r of the
// full h, bitwise.
TEST(SwigluLayout, TensorParallelRanksHoldGateUpBlocks) {
  const int64_t N = 5, F = 12, Fr = F / 2;
  KernelContext ctx;
  const Vec g = randn(N * F, 4121, 2.0), u = randn(N * F, 4122);
  std::vector<float> gu = cast_vec<float>(pack(g, u, N, F)), h(N * F);
  swiglu_packed_forward(ctx, view(h, {N, F}), view(gu, {N, 2 * F}));
  for (int64_t r = 0; r < 2; ++r) {
    Vec gr(N * Fr), ur(N * Fr);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Fr; ++j) gr[n * Fr + j] = g[n * F + r * Fr + j], ur[n * Fr + j] = u[n * F + r * Fr + j];
    std::vector<float> gur = cast_vec<float>(pack(gr, ur, N, Fr)), hr(N * Fr);
    swiglu_packed_forward(ctx, view(hr, {N, Fr}), view(gur, {N, 2 * Fr}));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Fr; ++j) ASSERT_EQ(hr[n * Fr + j], h[n * F + r * Fr + j]) << "rank " << r;
  }
}

// Saturated gates: g = +-100 and +-1000 (exp overflows in float) give
// silu = g or -0 and finite gradients, never NaN.
TEST(SwigluLimits, SaturatedGatesStayFinite) {
  KernelContext ctx;
  std::vector<float> g = {100.f, -100.f, 1000.f, -1000.f}, u(4, 2.f), dh(4, 3.f), h(4), dg(4), du(4);
  swiglu_forward(ctx, view(h, {4}), view(g, {4}), view(u, {4}));
  swiglu_backward(ctx, view(dg, {4}), view(du, {4}), view(dh, {4}), view(g, {4}), view(u, {4}));
  const Vec gd = to_f64(g);
  expect_near(h, ref_swiglu(gd, to_f64(u)), 1e-6, "h");
  SwigluGrads want = ref_swiglu_backward(to_f64(dh), gd, to_f64(u));
  expect_near(dg, want.dg, 1e-6, "dg");
  expect_near(du, want.du, 1e-6, "du");
}

// Central differences on L = sum(h * R) in float64 for g and u, separate
// and packed, against the kernels' F64 backward (dh = R).
TEST(SwigluGradCheck, FiniteDifferences) {
  const int64_t N = 4, F = 9;
  const double eps = 1e-6;
  KernelContext ctx;
  Vec g = randn(N * F, 4131, 2.0), u = randn(N * F, 4132), R = randn(N * F, 4133);
  Vec h(N * F);
  auto loss = [&]() {
    swiglu_forward(ctx, view(h, {N, F}), view(g, {N, F}), view(u, {N, F}));
    double L = 0;
    for (int64_t i = 0; i < N * F; ++i) L += h[i] * R[i];
    return L;
  };
  Vec dg(N * F), du(N * F);
  swiglu_backward(ctx, view(dg, {N, F}), view(du, {N, F}), view(R, {N, F}), view(g, {N, F}), view(u, {N, F}));
  EXPECT_LT(normwise_error(numeric_gradient(g, eps, loss), dg), 1e-6) << "dg";
  EXPECT_LT(normwise_error(numeric_gradient(u, eps, loss), du), 1e-6) << "du";

  Vec gu = pack(g, u, N, F);
  auto packed_loss = [&]() {
    swiglu_packed_forward(ctx, view(h, {N, F}), view(gu, {N, 2 * F}));
    double L = 0;
    for (int64_t i = 0; i < N * F; ++i) L += h[i] * R[i];
    return L;
  };
  Vec dgu(N * 2 * F);
  swiglu_packed_backward(ctx, view(dgu, {N, 2 * F}), view(R, {N, F}), view(gu, {N, 2 * F}));
  EXPECT_LT(normwise_error(numeric_gradient(gu, eps, packed_loss), dgu), 1e-6) << "dgu";
}

TEST(SwigluErrors, Shapes) {
  KernelContext ctx;
  std::vector<float> g(4 * 6), u(4 * 6), h(4 * 6), gu_odd(4 * 7), h3(4 * 3);
  std::vector<bf16> u16(4 * 6);
  expect_error([&] { swiglu_forward(ctx, view(h, {4, 6}), view(g, {4, 6}), view(u, {6, 4})); }, ErrorKind::Shape,
               {"swiglu_forward"});
  expect_error([&] { swiglu_forward(ctx, view(h, {4, 6}), view(g, {4, 6}), view(u16, {4, 6})); }, ErrorKind::Shape,
               {"swiglu_forward", "u"});
  expect_error([&] { swiglu_packed_forward(ctx, view(h3, {4, 3}), view(gu_odd, {4, 7})); }, ErrorKind::Shape,
               {"swiglu_packed_forward", "gu"});
  // h must be half the packed width.
  expect_error([&] { swiglu_packed_forward(ctx, view(h, {4, 6}), view(g, {4, 6})); }, ErrorKind::Shape,
               {"swiglu_packed_forward", "h"});
}

// Under metrics.op_profile every call counts once as an elementwise op.
TEST(SwigluProfile, CountsAsElementwise) {
  Timeline tl;
  tl.set_profiling(true);
  KernelContext ctx;
  ctx.timeline = &tl;
  std::vector<float> g = cast_vec<float>(randn(8, 4141)), u = g, h(8), dg(8), du(8), gu(16), dgu(16);
  swiglu_forward(ctx, view(h, {2, 4}), view(g, {2, 4}), view(u, {2, 4}));
  swiglu_backward(ctx, view(dg, {2, 4}), view(du, {2, 4}), view(h, {2, 4}), view(g, {2, 4}), view(u, {2, 4}));
  swiglu_packed_forward(ctx, view(h, {2, 4}), view(gu, {2, 8}));
  swiglu_packed_backward(ctx, view(dgu, {2, 8}), view(h, {2, 4}), view(gu, {2, 8}));
  EXPECT_EQ(tl.take_ops().calls[int(OpKind::Elementwise)], 4);
}

}  // namespace
}  // namespace xirang::test
