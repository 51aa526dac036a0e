// Tests for kernels/matmul.h: matmul (all transposes, alpha/beta) and the
// linear layer, each against the float64 reference in reference.h.
//
// fp32 tolerance: 1e-5 of max(1, max|ref|). The products here are dot
// products of K <= 48 terms of unit-scale values; the fp32 error (unit
// roundoff 6e-8, BLAS blocking and FMA included) grows like sqrt(K) * 6e-8 *
// |terms|, about 1e-6 of the result's scale. 1e-5 leaves a 10x margin while an
// indexing or transpose bug shows as an O(1) error.
#include <cmath>
#include <limits>

#include "kernels/matmul.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
class MatmulTest : public ::testing::Test {};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MatmulTest, ComputeTypes);

// The four transpose combinations with alpha and beta both away from 1 and
// 0, and an output pre-filled with random values so beta's term is checked.
TYPED_TEST(MatmulTest, AllTransposesWithAlphaBeta) {
  using T = TypeParam;
  const int64_t M = 37, N = 29, K = 48;
  const double alpha = 0.75, beta = -0.625;
  KernelContext ctx;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(testing::Message() << "trans_a " << ta << " trans_b " << tb);
      auto a = cast_vec<T>(randn(M * K, 1 + 2 * ta + tb));
      auto b = cast_vec<T>(randn(K * N, 11 + 2 * ta + tb));
      auto out = cast_vec<T>(randn(M * N, 21 + 2 * ta + tb));
      Vec ref = to_f64(out);
      ref_matmul(ref, to_f64(a), to_f64(b), M, N, K, ta, tb, alpha, beta);
      Shape sa = ta ? Shape{K, M} : Shape{M, K};
      Shape sb = tb ? Shape{N, K} : Shape{K, N};
      matmul(ctx, view(out, {M, N}), view(a, sa), view(b, sb), ta, tb, alpha, beta);
      expect_near(out, ref, tol<T>(kTolF32), "matmul out");
    }
}

// Default alpha = 1, beta = 0: the output's previous contents must not
// matter, even when they are NaN. Arena memory is reused between steps, so
// stale NaN in an output buffer is a real situation (BLAS does not read C
// when beta is 0).
TYPED_TEST(MatmulTest, BetaZeroIgnoresStaleOutput) {
  using T = TypeParam;
  const int64_t M = 13, N = 7, K = 19;
  KernelContext ctx;
  auto a = cast_vec<T>(randn(M * K, 31));
  auto b = cast_vec<T>(randn(K * N, 32));
  std::vector<T> out(M * N, std::numeric_limits<T>::quiet_NaN());
  Vec ref(M * N, 0.0);
  ref_matmul(ref, to_f64(a), to_f64(b), M, N, K, false, false, 1.0, 0.0);
  matmul(ctx, view(out, {M, N}), view(a, {M, K}), view(b, {K, N}), false, false);
  expect_near(out, ref, tol<T>(kTolF32), "matmul out");
}

template <class T>
class LinearTest : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, In = 48, Out = 29;
  KernelContext ctx;
  std::vector<T> x = cast_vec<T>(randn(N * In, 41));
  std::vector<T> w = cast_vec<T>(randn(Out * In, 42, 0.2));
  std::vector<T> b = cast_vec<T>(randn(Out, 43));
  std::vector<T> dy = cast_vec<T>(randn(N * Out, 44));
};
TYPED_TEST_SUITE(LinearTest, ComputeTypes);

TYPED_TEST(LinearTest, ForwardWithBias) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y = cast_vec<T>(randn(f.N * f.Out, 45));  // garbage that must be overwritten
  linear_forward(f.ctx, view(y, {f.N, f.Out}), view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), view(f.b, {f.Out}));
  expect_near(y, ref_linear_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.In, f.Out), tol<T>(kTolF32), "y");
}

// An undefined bias means none: y = x W^T exactly.
TYPED_TEST(LinearTest, ForwardWithoutBias) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y = cast_vec<T>(randn(f.N * f.Out, 46));
  linear_forward(f.ctx, view(y, {f.N, f.Out}), view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), Tensor{});
  expect_near(y, ref_linear_forward(to_f64(f.x), to_f64(f.w), {}, f.N, f.In, f.Out), tol<T>(kTolF32), "y");
}

// A 3-D activation (B, T, in) is flattened by the caller; check that a
// flat2d view of it goes through unchanged.
TYPED_TEST(LinearTest, ForwardOnFlattenedBatch) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y = cast_vec<T>(randn(f.N * f.Out, 47));
  Tensor x3 = view(f.x, {1, f.N, f.In});
  linear_forward(f.ctx, view(y, {f.N, f.Out}), x3.flat2d(), view(f.w, {f.Out, f.In}), view(f.b, {f.Out}));
  expect_near(y, ref_linear_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.In, f.Out), tol<T>(kTolF32), "y");
}

// Overwrite: dx is the gradient alone; dw and dbias always accumulate onto
// their random previous contents (gradients add over microbatches).
TYPED_TEST(LinearTest, BackwardOverwrite) {
  using T = TypeParam;
  auto& f = *this;
  auto dx = cast_vec<T>(randn(f.N * f.In, 51));
  auto dw = cast_vec<T>(randn(f.Out * f.In, 52));
  auto db = cast_vec<T>(randn(f.Out, 53));
  Vec dw0 = to_f64(dw), db0 = to_f64(db);
  linear_backward(f.ctx, view(dx, {f.N, f.In}), view(dw, {f.Out, f.In}), view(db, {f.Out}), view(f.dy, {f.N, f.Out}),
                  view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), GradMode::Overwrite);
  LinearGrads g = ref_linear_backward(to_f64(f.dy), to_f64(f.x), to_f64(f.w), f.N, f.In, f.Out);
  expect_near(dx, g.dx, tol<T>(kTolF32), "dx");
  expect_near(dw, plus(dw0, g.dw), tol<T>(kTolF32), "dw");
  expect_near(db, plus(db0, g.db), tol<T>(kTolF32), "dbias");
}

TYPED_TEST(LinearTest, BackwardAccumulate) {
  using T = TypeParam;
  auto& f = *this;
  auto dx = cast_vec<T>(randn(f.N * f.In, 54));
  auto dw = cast_vec<T>(randn(f.Out * f.In, 55));
  auto db = cast_vec<T>(randn(f.Out, 56));
  Vec dx0 = to_f64(dx), dw0 = to_f64(dw), db0 = to_f64(db);
  linear_backward(f.ctx, view(dx, {f.N, f.In}), view(dw, {f.Out, f.In}), view(db, {f.Out}), view(f.dy, {f.N, f.Out}),
                  view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), GradMode::Accumulate);
  LinearGrads g = ref_linear_backward(to_f64(f.dy), to_f64(f.x), to_f64(f.w), f.N, f.In, f.Out);
  expect_near(dx, plus(dx0, g.dx), tol<T>(kTolF32), "dx");
  expect_near(dw, plus(dw0, g.dw), tol<T>(kTolF32), "dw");
  expect_near(db, plus(db0, g.db), tol<T>(kTolF32), "dbias");
}

// The first layer needs no dx and a bias-free layer has no dbias: both
// undefined, and dw must still be right.
TYPED_TEST(LinearTest, BackwardWithoutDxAndBias) {
  using T = TypeParam;
  auto& f = *this;
  auto dw = cast_vec<T>(randn(f.Out * f.In, 57));
  Vec dw0 = to_f64(dw);
  linear_backward(f.ctx, Tensor{}, view(dw, {f.Out, f.In}), Tensor{}, view(f.dy, {f.N, f.Out}), view(f.x, {f.N, f.In}),
                  view(f.w, {f.Out, f.In}), GradMode::Overwrite);
  LinearGrads g = ref_linear_backward(to_f64(f.dy), to_f64(f.x), to_f64(f.w), f.N, f.In, f.Out);
  expect_near(dw, plus(dw0, g.dw), tol<T>(kTolF32), "dw");
}

// ---------------------------------------------------------------- errors

TEST(LinearErrors, WrongInFeaturesNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 7), y(5 * 3);
  expect_error([&] { linear_forward(ctx, view(y, {5, 3}), view(x, {5, 8}), view(w, {3, 7}), Tensor{}); },
               ErrorKind::Shape, {"linear"});
}

TEST(LinearErrors, WrongOutputShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 8), y(5 * 4);
  expect_error([&] { linear_forward(ctx, view(y, {5, 4}), view(x, {5, 8}), view(w, {3, 8}), Tensor{}); },
               ErrorKind::Shape, {"linear"});
}

TEST(LinearErrors, WrongBiasShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 8), y(5 * 3), b(4);
  expect_error([&] { linear_forward(ctx, view(y, {5, 3}), view(x, {5, 8}), view(w, {3, 8}), view(b, {4})); },
               ErrorKind::Shape, {"linear"});
}

TEST(LinearErrors, BackwardWrongDwShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 8), dy(5 * 3), dx(5 * 8), dw(3 * 7);
  expect_error([&] {
    linear_backward(ctx, view(dx, {5, 8}), view(dw, {3, 7}), Tensor{}, view(dy, {5, 3}), view(x, {5, 8}),
                    view(w, {3, 8}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"linear"});
}

TEST(MatmulErrors, InnerDimensionMismatchNamesTheOp) {
  KernelContext ctx;
  std::vector<float> a(4 * 5), b(6 * 3), out(4 * 3);
  expect_error([&] { matmul(ctx, view(out, {4, 3}), view(a, {4, 5}), view(b, {6, 3}), false, false); },
               ErrorKind::Shape, {"matmul"});
}

// The header says all three tensors share the dtype; mixing is an error, not
// a silent reinterpretation of the bytes.
TEST(MatmulErrors, MixedDtypesRejected) {
  KernelContext ctx;
  std::vector<float> a(4 * 5), out(4 * 3);
  std::vector<double> b(5 * 3);
  expect_error([&] { matmul(ctx, view(out, {4, 3}), view(a, {4, 5}), view(b, {5, 3}), false, false); },
               ErrorKind::Shape, {"matmul"});
}

}  // namespace
}  // namespace xirang::test
