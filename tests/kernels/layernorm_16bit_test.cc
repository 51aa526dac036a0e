// Tests for kernels/layernorm.h with BF16 and F16 storage: F32 statistics,
// 16-bit or F32 parameter gradients, and residual_layernorm_forward against
// add() + layernorm_forward() in every dtype.
//
// Tolerances. Inputs are rounded to S first and the float64 reference reads
// those values. Statistics accumulate in double and are stored in F32, so
// mean and rstd carry one fp32 rounding: the fp32 tolerance of
// layernorm_test.cc (1e-5). y is formed in float (~1e-7 relative) and rounded
// once to S; dx is formed in double and rounded once; 16-bit dw and db are
// rounded once after adding to their prior value. Each is then within
// u = 2^-8 (bf16) or 2^-11 (f16) of the max(1, max|ref|) scale; the
// tolerance is 2u, and >= 97% of the elements must equal the reference
// rounded once. F32 dw and db (mixed precision) keep the fp32 tolerance.
#include <cmath>

#include "kernels/elementwise.h"
#include "kernels/layernorm.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;
constexpr double kMinRounded = 0.97;

template <class S>
class LayerNorm16Test : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, C = 48;
  static constexpr double kTol = 2 * unit_roundoff<S>();
  KernelContext ctx;
  std::vector<S> x = cast_vec<S>(randn(N * C, 1101, 2.0, 0.5));
  std::vector<S> w = cast_vec<S>(randn(C, 1102, 0.5, 1.0));
  std::vector<S> b = cast_vec<S>(randn(C, 1103, 0.5));
  std::vector<S> dy = cast_vec<S>(randn(N * C, 1104));

  void forward(std::vector<S>& y, std::vector<float>& mean, std::vector<float>& rstd) {
    y = cast_vec<S>(randn(N * C, 1105));
    mean = cast_vec<float>(randn(N, 1106));
    rstd = cast_vec<float>(randn(N, 1107));
    layernorm_forward(ctx, view(y, {N, C}), view(mean, {N}), view(rstd, {N}), view(x, {N, C}), view(w, {C}),
                      view(b, {C}));
  }
};
using Storage16 = ::testing::Types<bf16, f16>;
TYPED_TEST_SUITE(LayerNorm16Test, Storage16);

TYPED_TEST(LayerNorm16Test, Forward) {
  using S = TypeParam;
  auto& f = *this;
  std::vector<S> y;
  std::vector<float> mean, rstd;
  f.forward(y, mean, rstd);
  LayerNormOut r = ref_layernorm_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.C);
  expect_near(y, r.y, f.kTol, "y");
  expect_mostly_rounded(y, r.y, kMinRounded, "y");
  expect_near(mean, r.mean, kTolF32, "mean (f32)");
  expect_near(rstd, r.rstd, kTolF32, "rstd (f32)");
}

// dx per mode; dw and db in S and in F32, on random prior contents.
TYPED_TEST(LayerNorm16Test, Backward) {
  using S = TypeParam;
  auto& f = *this;
  std::vector<S> y;
  std::vector<float> mean, rstd;
  f.forward(y, mean, rstd);
  LayerNormGrads g = ref_layernorm_backward(to_f64(f.dy), to_f64(f.x), to_f64(f.w), f.N, f.C);
  for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate}) {
    SCOPED_TRACE(mode == GradMode::Overwrite ? "Overwrite" : "Accumulate");
    auto dx = cast_vec<S>(randn(f.N * f.C, 1111));
    auto dw = cast_vec<S>(randn(f.C, 1112));
    auto db = cast_vec<S>(randn(f.C, 1113));
    Vec dx0 = to_f64(dx), dw0 = to_f64(dw), db0 = to_f64(db);
    layernorm_backward(f.ctx, view(dx, {f.N, f.C}), view(dw, {f.C}), view(db, {f.C}), view(f.dy, {f.N, f.C}),
                       view(f.x, {f.N, f.C}), view(f.w, {f.C}), view(mean, {f.N}), view(rstd, {f.N}), mode);
    Vec want_dx = mode == GradMode::Overwrite ? g.dx : plus(dx0, g.dx);
    expect_near(dx, want_dx, f.kTol, "dx");
    expect_mostly_rounded(dx, want_dx, kMinRounded, "dx");
    expect_near(dw, plus(dw0, g.dw), f.kTol, "dw");
    expect_near(db, plus(db0, g.db), f.kTol, "db");
  }
  // F32 parameter gradients, twice (two microbatches).
  auto dx = cast_vec<S>(randn(f.N * f.C, 1114));
  auto dw = cast_vec<float>(randn(f.C, 1115));
  auto db = cast_vec<float>(randn(f.C, 1116));
  Vec want_w = to_f64(dw), want_b = to_f64(db);
  for (int micro = 0; micro < 2; ++micro) {
    layernorm_backward(f.ctx, view(dx, {f.N, f.C}), view(dw, {f.C}), view(db, {f.C}), view(f.dy, {f.N, f.C}),
                       view(f.x, {f.N, f.C}), view(f.w, {f.C}), view(mean, {f.N}), view(rstd, {f.N}),
                       GradMode::Overwrite);
    want_w = plus(want_w, g.dw);
    want_b = plus(want_b, g.db);
  }
  expect_near(dw, want_w, kTolF32, "f32 dw");
  expect_near(db, want_b, kTolF32, "f32 db");
}

// ---------------------------------------------------------------- residual + LayerNorm

template <class T>
class ResidualLayerNormTest : public ::testing::Test {};
using AllStorage = ::testing::Types<float, double, bf16, f16>;
TYPED_TEST_SUITE(ResidualLayerNormTest, AllStorage);

// res = a + b, y = LayerNorm(res) against add() then layernorm_forward():
// bitwise equal in every dtype, also with res aliasing a (the residual
// stream updated in place). Odd sizes: 29 rows of 37.
TYPED_TEST(ResidualLayerNormTest, MatchesUnfusedBitwise) {
  using S = TypeParam;
  using St = std::conditional_t<is_16bit_v<S>, float, S>;
  const int64_t N = 29, C = 37;
  KernelContext ctx;
  auto a = cast_vec<S>(randn(N * C, 1121, 1.5, 0.2));
  auto b = cast_vec<S>(randn(N * C, 1122));
  auto w = cast_vec<S>(randn(C, 1123, 0.5, 1.0));
  auto bias = cast_vec<S>(randn(C, 1124, 0.5));
  // Unfused.
  auto res_ref = cast_vec<S>(randn(N * C, 1125));
  auto y_ref = cast_vec<S>(randn(N * C, 1126));
  auto m_ref = cast_vec<St>(randn(N, 1127)), r_ref = cast_vec<St>(randn(N, 1128));
  add(ctx, view(res_ref, {N, C}), view(a, {N, C}), view(b, {N, C}));
  layernorm_forward(ctx, view(y_ref, {N, C}), view(m_ref, {N}), view(r_ref, {N}), view(res_ref, {N, C}), view(w, {C}),
                    view(bias, {C}));
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "res aliases a" : "separate res");
    auto a_in = a;
    auto res = cast_vec<S>(randn(N * C, 1129));
    auto y = cast_vec<S>(randn(N * C, 1130));
    auto m = cast_vec<St>(randn(N, 1131)), r = cast_vec<St>(randn(N, 1132));
    std::vector<S>& res_out = in_place ? a_in : res;
    residual_layernorm_forward(ctx, view(res_out, {N, C}), view(y, {N, C}), view(m, {N}), view(r, {N}),
                               view(a_in, {N, C}), view(b, {N, C}), view(w, {C}), view(bias, {C}));
    EXPECT_EQ(bytes_of(res_out), bytes_of(res_ref)) << "res";
    EXPECT_EQ(bytes_of(y), bytes_of(y_ref)) << "y";
    EXPECT_EQ(bytes_of(m), bytes_of(m_ref)) << "mean";
    EXPECT_EQ(bytes_of(r), bytes_of(r_ref)) << "rstd";
  }
  // And the float64 reference of LayerNorm(a + b) for the wide types (the
  // 16-bit ones are covered by the bitwise match above and the tests of add
  // and layernorm_forward).
  if constexpr (!is_16bit_v<S>) {
    LayerNormOut want = ref_layernorm_forward(plus(to_f64(a), to_f64(b)), to_f64(w), to_f64(bias), N, C);
    expect_near(y_ref, want.y, tol<S>(kTolF32), "y against the reference");
  }
}

// ---------------------------------------------------------------- dtype rules

TEST(LayerNorm16Errors, StatisticsAndGradientDtypes) {
  KernelContext ctx;
  const int64_t N = 4, C = 8;
  std::vector<bf16> x(N * C), y(N * C), w(C), b(C), dy(N * C), dx(N * C), m16(N), r16(N);
  std::vector<float> m(N), r(N), dw32(C), db32(C);
  std::vector<f16> dw_f16(C);
  // Saved statistics are F32 beside bf16 activations.
  expect_error([&] {
    layernorm_forward(ctx, view(y, {N, C}), view(m16, {N}), view(r, {N}), view(x, {N, C}), view(w, {C}), view(b, {C}));
  }, ErrorKind::Shape, {"layernorm_forward", "mean", "f32"});
  expect_error([&] {
    layernorm_backward(ctx, view(dx, {N, C}), view(dw32, {C}), view(db32, {C}), view(dy, {N, C}), view(x, {N, C}),
                       view(w, {C}), view(m, {N}), view(r16, {N}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"layernorm_backward", "rstd"});
  // dw is bf16 or f32, not f16.
  expect_error([&] {
    layernorm_backward(ctx, view(dx, {N, C}), view(dw_f16, {C}), view(db32, {C}), view(dy, {N, C}), view(x, {N, C}),
                       view(w, {C}), view(m, {N}), view(r, {N}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"layernorm_backward", "dw"});
  // residual_layernorm_forward: a and b share the dtype.
  std::vector<float> b32(N * C);
  expect_error([&] {
    residual_layernorm_forward(ctx, view(x, {N, C}), view(y, {N, C}), view(m, {N}), view(r, {N}), view(x, {N, C}),
                               view(b32, {N, C}), view(w, {C}), view(b, {C}));
  }, ErrorKind::Shape, {"residual_layernorm_forward", "b"});
}

}  // namespace
}  // namespace xirang::test
