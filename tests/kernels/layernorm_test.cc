// Tests for kernels/layernorm.h against the float64 reference, plus a
// finite-difference check of the float64 backward that does not depend on
// the hand-derived reference gradient.
//
// fp32 tolerance: 1e-5 of max(1, max|ref|). Statistics accumulate in double
// (header), so y carries only a few fp32 roundings (~1e-7 relative); the
// backward sums C = 48 (dx) or N = 37 (dw, db) products of unit-scale
// values, ~1e-6 of the scale. 1e-5 keeps a 10x margin.
#include <cmath>

#include "kernels/layernorm.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
class LayerNormTest : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, C = 48;
  KernelContext ctx;
  // Rows with a non-zero mean (shift 0.5) and variance 4, so that both the
  // mean subtraction and the scaling by rstd matter.
  std::vector<T> x = cast_vec<T>(randn(N * C, 101, 2.0, 0.5));
  std::vector<T> w = cast_vec<T>(randn(C, 102, 0.5, 1.0));
  std::vector<T> b = cast_vec<T>(randn(C, 103, 0.5));
  std::vector<T> dy = cast_vec<T>(randn(N * C, 104));

  // Runs the kernel forward on fresh random outputs; returns y, mean, rstd.
  void forward(std::vector<T>& y, std::vector<T>& mean, std::vector<T>& rstd) {
    y = cast_vec<T>(randn(N * C, 105));
    mean = cast_vec<T>(randn(N, 106));
    rstd = cast_vec<T>(randn(N, 107));
    layernorm_forward(ctx, view(y, {N, C}), view(mean, {N}), view(rstd, {N}), view(x, {N, C}), view(w, {C}),
                      view(b, {C}));
  }
};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(LayerNormTest, ComputeTypes);

// y and the saved statistics (mean, rstd with eps 1e-5 and biased variance).
TYPED_TEST(LayerNormTest, Forward) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y, mean, rstd;
  f.forward(y, mean, rstd);
  LayerNormOut r = ref_layernorm_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.C);
  expect_near(y, r.y, tol<T>(kTolF32), "y");
  expect_near(mean, r.mean, tol<T>(kTolF32), "mean");
  expect_near(rstd, r.rstd, tol<T>(kTolF32), "rstd");
}

// Rows with variance ~1e-4 around a mean of 0.3: eps = 1e-5 is then 10% of
// the variance, so a wrong eps or an unbiased variance shows even in fp32,
// and a single-pass float variance (E[x^2] - E[x]^2) would lose most of its
// digits to cancellation.
TYPED_TEST(LayerNormTest, SmallVarianceRowsUseEps) {
  using T = TypeParam;
  auto& f = *this;
  f.x = cast_vec<T>(randn(f.N * f.C, 131, 0.01, 0.3));
  std::vector<T> y, mean, rstd;
  f.forward(y, mean, rstd);
  LayerNormOut r = ref_layernorm_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.C);
  expect_near(y, r.y, tol<T>(kTolF32), "y");
  expect_near(mean, r.mean, tol<T>(kTolF32), "mean");
  // rstd ~ 90 here; compare relative to its own size.
  Vec got = to_f64(rstd), want = r.rstd;
  for (size_t i = 0; i < got.size(); ++i) got[i] /= want[i], want[i] = 1.0;
  expect_near(got, want, tol<T>(kTolF32), "rstd / reference rstd");
}

// dx in both modes; dw and db always accumulate onto random prior contents.
TYPED_TEST(LayerNormTest, Backward) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y, mean, rstd;
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
    expect_near(dx, mode == GradMode::Overwrite ? g.dx : plus(dx0, g.dx), tol<T>(kTolF32), "dx");
    expect_near(dw, plus(dw0, g.dw), tol<T>(kTolF32), "dw");
    expect_near(db, plus(db0, g.db), tol<T>(kTolF32), "db");
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

}  // namespace
}  // namespace xirang::test
