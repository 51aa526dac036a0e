// Tests for kernels/layernorm.h against the float64 reference, in every
// storage type (f64, f32, bf16, f16; 16-bit activations keep F32 statistics
// and take 16-bit or F32 parameter gradients), residual_layernorm_forward
// against add() + layernorm_forward(), and a finite-difference check of the
// float64 backward that does not depend on the hand-derived reference
// gradient.
//
// Tolerances, relative to max(1, max|ref|) (LayerNormTol below):
// - f32: 1e-5. Statistics accumulate in double (header), so y carries only
//   a few fp32 roundings (~1e-7 relative); the backward sums C = 48 (dx) or
//   N = 37 (dw, db) products of unit-scale values, ~1e-6 of the scale. 1e-5
//   keeps a 10x margin.
// - f64: 1e-10, only the order of operations differs from the reference.
// - 16-bit (inputs rounded to the type first; the reference reads those
//   values): mean and rstd are formed in double and stored in F32, one fp32
//   rounding: the f32 tolerance. y is formed in float (~1e-7 relative) and
//   rounded once; dx is formed in double and rounded once; 16-bit dw and db
//   are rounded once after adding to their prior value. Each is then within
//   u = 2^-8 (bf16) or 2^-11 (f16) of the scale: the tolerance is 2u, and
//   >= 97% of the elements of y and dx must equal the reference rounded
//   once. F32 dw and db beside 16-bit activations (mixed precision) keep the
//   f32 tolerance.
#include <cmath>

#include "kernels/elementwise.h"
#include "kernels/layernorm.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
struct LayerNormTol {
  static constexpr double out = stored_tol<T>(kTolF32, 2);   // y, dx, dw, db stored as T
  static constexpr double stats = tol<StatType<T>>(kTolF32);  // mean, rstd
  static constexpr double rounded = 0.97;                     // 16-bit: fraction rounded once
};

template <class T>
class LayerNormTest : public ::testing::Test {
 protected:
  using Tol = LayerNormTol<T>;
  using St = StatType<T>;
  static constexpr int64_t N = 37, C = 48;
  KernelContext ctx;
  // Rows with a non-zero mean (shift 0.5) and variance 4, so that both the
  // mean subtraction and the scaling by rstd matter.
  std::vector<T> x = cast_vec<T>(randn(N * C, 101, 2.0, 0.5));
  std::vector<T> w = cast_vec<T>(randn(C, 102, 0.5, 1.0));
  std::vector<T> b = cast_vec<T>(randn(C, 103, 0.5));
  std::vector<T> dy = cast_vec<T>(randn(N * C, 104));

  // Runs the kernel forward on fresh random outputs; returns y, mean, rstd.
  void forward(std::vector<T>& y, std::vector<St>& mean, std::vector<St>& rstd) {
    y = cast_vec<T>(randn(N * C, 105));
    mean = cast_vec<St>(randn(N, 106));
    rstd = cast_vec<St>(randn(N, 107));
    layernorm_forward(ctx, view(y, {N, C}), view(mean, {N}), view(rstd, {N}), view(x, {N, C}), view(w, {C}),
                      view(b, {C}));
  }
};
TYPED_TEST_SUITE(LayerNormTest, StorageTypes, StorageTypeNames);

// y and the saved statistics (mean, rstd with eps 1e-5 and biased variance).
TYPED_TEST(LayerNormTest, Forward) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y;
  std::vector<StatType<T>> mean, rstd;
  f.forward(y, mean, rstd);
  LayerNormOut r = ref_layernorm_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.C);
  expect_stored(y, r.y, TestFixture::Tol::out, TestFixture::Tol::rounded, "y");
  expect_near(mean, r.mean, TestFixture::Tol::stats, "mean");
  expect_near(rstd, r.rstd, TestFixture::Tol::stats, "rstd");
}

// Rows with variance ~1e-4 around a mean of 0.3: eps = 1e-5 is then 10% of
// the variance, so a wrong eps or an unbiased variance shows even in fp32,
// and a single-pass float variance (E[x^2] - E[x]^2) would lose most of its
// digits to cancellation.
TYPED_TEST(LayerNormTest, SmallVarianceRowsUseEps) {
  using T = TypeParam;
  auto& f = *this;
  f.x = cast_vec<T>(randn(f.N * f.C, 131, 0.01, 0.3));
  std::vector<T> y;
  std::vector<StatType<T>> mean, rstd;
  f.forward(y, mean, rstd);
  LayerNormOut r = ref_layernorm_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.C);
  expect_near(y, r.y, TestFixture::Tol::out, "y");
  expect_near(mean, r.mean, TestFixture::Tol::stats, "mean");
  // rstd ~ 90 here; compare relative to its own size.
  Vec got = to_f64(rstd), want = r.rstd;
  for (size_t i = 0; i < got.size(); ++i) got[i] /= want[i], want[i] = 1.0;
  expect_near(got, want, TestFixture::Tol::stats, "rstd / reference rstd");
}

// dx in both modes; dw and db always accumulate onto random prior contents.
// Beside 16-bit activations the parameter gradients may also be F32, summed
// over two calls (two microbatches) with no 16-bit rounding.
TYPED_TEST(LayerNormTest, Backward) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y;
  std::vector<StatType<T>> mean, rstd;
  f.forward(y, mean, rstd);
  LayerNormGrads g = ref_layernorm_backward(to_f64(f.dy), to_f64(f.x), to_f64(f.w), f.N, f.C);
  for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate}) {
    SCOPED_TRACE(mode == GradMode::Overwrite ? "Overwrite" : "Accumulate");
    auto dx = cast_vec<T>(randn(f.N * f.C, 111));
    auto dw = cast_vec<T>(randn(f.C, 112));
    auto db = cast_vec<T>(randn(f.C, 113));
    Vec dx0 = to_f64(dx), dw0 = to_f64(dw), db0 = to_f64(db);
    layernorm_backward(f.ctx, view(dx, {f.N, f.C}), view(dw, {f.C}), view(db, {f.C}), view(f.dy, {f.N, f.C}),
                       view(f.x, {f.N, f.C}), view(f.w, {f.C}), view(mean, {f.N}), view(rstd, {f.N}), mode);
    expect_stored(dx, mode == GradMode::Overwrite ? g.dx : plus(dx0, g.dx), TestFixture::Tol::out, TestFixture::Tol::rounded, "dx");
    expect_near(dw, plus(dw0, g.dw), TestFixture::Tol::out, "dw");
    expect_near(db, plus(db0, g.db), TestFixture::Tol::out, "db");
  }
  if constexpr (is_16bit_v<T>) {
    auto dx = cast_vec<T>(randn(f.N * f.C, 114));
    auto dw = cast_vec<float>(randn(f.C, 115));
    auto db = cast_vec<float>(randn(f.C, 116));
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
}

// res = a + b, y = LayerNorm(res) against add() then layernorm_forward():
// bitwise equal in every dtype, also with res aliasing a (the residual
// stream updated in place). Odd sizes: 29 rows of 37.
TYPED_TEST(LayerNormTest, ResidualMatchesUnfusedBitwise) {
  using S = TypeParam;
  using St = StatType<S>;
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
    expect_near(y_ref, want.y, LayerNormTol<S>::out, "y against the reference");
  }
}

// Central differences on L = sum(y * R) for random R, in float64, against
// the kernel's own F64 backward (dy = R). h = 1e-6: truncation ~h^2 = 1e-12,
// roundoff ~1e-16 |L| / h ~ 1e-9, both far below the 1e-6 norm-wise bound.
TEST(LayerNormGradCheck, FiniteDifferences) {
  const int64_t N = 5, C = 16;
  const double h = 1e-6;
  KernelContext ctx;
  Vec x = randn(N * C, 121, 1.5, 0.3), w = randn(C, 122, 0.5, 1.0), b = randn(C, 123), R = randn(N * C, 124);
  Vec y(N * C), mean(N), rstd(N);
  auto loss = [&]() {
    layernorm_forward(ctx, view(y, {N, C}), view(mean, {N}), view(rstd, {N}), view(x, {N, C}), view(w, {C}),
                      view(b, {C}));
    double L = 0;
    for (int64_t i = 0; i < N * C; ++i) L += y[i] * R[i];
    return L;
  };
  loss();
  Vec dx(N * C), dw(C, 0.0), db(C, 0.0);
  layernorm_backward(ctx, view(dx, {N, C}), view(dw, {C}), view(db, {C}), view(R, {N, C}), view(x, {N, C}),
                     view(w, {C}), view(mean, {N}), view(rstd, {N}), GradMode::Overwrite);
  // Every element of every input, compared norm-wise.
  EXPECT_LT(normwise_error(numeric_gradient(x, h, loss), dx), 1e-6) << "dx";
  EXPECT_LT(normwise_error(numeric_gradient(w, h, loss), dw), 1e-6) << "dw";
  EXPECT_LT(normwise_error(numeric_gradient(b, h, loss), db), 1e-6) << "db";
}

TEST(LayerNormErrors, WrongWeightShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(4 * 8), y(4 * 8), mean(4), rstd(4), w(7), b(8);
  expect_error([&] {
    layernorm_forward(ctx, view(y, {4, 8}), view(mean, {4}), view(rstd, {4}), view(x, {4, 8}), view(w, {7}),
                      view(b, {8}));
  }, ErrorKind::Shape, {"layernorm"});
}

TEST(LayerNormErrors, WrongOutputShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(4 * 8), y(4 * 9), mean(4), rstd(4), w(8), b(8);
  expect_error([&] {
    layernorm_forward(ctx, view(y, {4, 9}), view(mean, {4}), view(rstd, {4}), view(x, {4, 8}), view(w, {8}),
                      view(b, {8}));
  }, ErrorKind::Shape, {"layernorm"});
}

// The backward reads w, mean and rstd with the row width and count of x, so
// a wrongly shaped one must be rejected, not read out of bounds. (The
// buffers here are larger than needed, so a missing check shows as a test
// failure rather than a crash.)
TEST(LayerNormErrors, BackwardWrongStatisticsOrWeightShapeNamesTheOp) {
  KernelContext ctx;
  const int64_t N = 4, C = 8;
  std::vector<float> x(N * C, 1.0f), dy(N * C, 1.0f), dx(N * C), dw(C), db(C);
  std::vector<float> w(C, 1.0f), w_big(C + 1, 1.0f), mean(N), mean_big(N + 1), rstd(N, 1.0f), rstd_big(N + 1, 1.0f);
  auto run = [&](std::vector<float>& wv, std::vector<float>& mv, std::vector<float>& rv) {
    layernorm_backward(ctx, view(dx, {N, C}), view(dw, {C}), view(db, {C}), view(dy, {N, C}), view(x, {N, C}),
                       view(wv, {int64_t(wv.size())}), view(mv, {int64_t(mv.size())}), view(rv, {int64_t(rv.size())}),
                       GradMode::Overwrite);
  };
  expect_error([&] { run(w, mean_big, rstd); }, ErrorKind::Shape, {"layernorm", "mean"});
  expect_error([&] { run(w, mean, rstd_big); }, ErrorKind::Shape, {"layernorm", "rstd"});
  expect_error([&] { run(w_big, mean, rstd); }, ErrorKind::Shape, {"layernorm", "w"});
}

// Statistics are F32 beside 16-bit activations; dw is bf16 or f32.
TEST(LayerNormErrors, StatisticsAndGradientDtypesBeside16Bit) {
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
