// Tests for kernels/cross_entropy.h (softmax cross entropy over a padded
// vocabulary, fused with its gradient) against the float64 reference, plus
// a finite-difference check of the F64 gradient.
//
// fp32 tolerance: 1e-5 of max(1, max|ref|). The loss is a log-sum-exp over
// V = 300 entries (relative error ~1e-6 with the max subtracted); each
// gradient entry is one softmax value minus the one-hot, times dloss.
#include <omp.h>

#include <cmath>

#include "kernels/cross_entropy.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
class CrossEntropyTest : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, Vp = 384, V = 300;
  KernelContext ctx;
  std::vector<T> logits = make_logits();
  std::vector<int32_t> targets = make_targets();
  const double dloss = 1.0 / double(N);

  // Real columns have scale 3 (a peaked softmax); padding columns hold huge
  // values (around +1e4) that would dominate the softmax, or underflow every
  // real exp() to zero if they were let into the running max.
  static std::vector<T> make_logits() {
    Vec l = randn(N * Vp, 401, 3.0);
    Vec pad = randn(N * Vp, 402, 100.0, 1e4);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = V; j < Vp; ++j) l[n * Vp + j] = pad[n * Vp + j];
    return cast_vec<T>(l);
  }
  // Random targets, with the first and last real columns forced into two
  // rows (off-by-one edges).
  static std::vector<int32_t> make_targets() {
    auto t = rand_int(N, 403, 0, int32_t(V));
    t[0] = 0;
    t[N - 1] = int32_t(V - 1);
    return t;
  }
  CrossEntropyOut reference() const {
    return ref_cross_entropy(to_f64(logits), targets, N, Vp, V, dloss);
  }
};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(CrossEntropyTest, ComputeTypes);

// Losses and dlogits into separate buffers pre-filled with random values;
// padding columns of dlogits must come out exactly zero.
TYPED_TEST(CrossEntropyTest, LossesAndGradient) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, Vp = f.Vp, V = f.V;
  auto losses = cast_vec<T>(randn(N, 404));
  auto dlogits = cast_vec<T>(randn(N * Vp, 405));
  cross_entropy_forward_backward(f.ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(f.logits, {N, Vp}),
                                 view(f.targets, {N}), V, f.dloss);
  CrossEntropyOut r = f.reference();
  expect_near(losses, r.losses, tol<T>(kTolF32), "losses");
  // dlogits is O(dloss) = O(1/37); compare against its own scale, not 1, so
  // the tolerance is not 37x looser than it looks.
  auto scaled = [&](const std::vector<T>& d) {
    Vec s = to_f64(d);
    for (double& x : s) x /= f.dloss;
    return s;
  };
  Vec ref_scaled = r.dlogits;
  for (double& x : ref_scaled) x /= f.dloss;
  expect_near(scaled(dlogits), ref_scaled, tol<T>(kTolF32), "dlogits / dloss");
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) ASSERT_EQ(dlogits[n * Vp + j], T(0)) << "padding dlogits[" << n << ", " << j << "]";
  // The logits are inputs and stay untouched when not aliased.
  EXPECT_EQ(f.logits, f.make_logits());
}

// dlogits aliasing logits: the gradient overwrites the logits in place (how
// the model avoids a second (N, Vp) buffer). Results must be the same.
TYPED_TEST(CrossEntropyTest, GradientInPlaceOverLogits) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, Vp = f.Vp, V = f.V;
  CrossEntropyOut r = f.reference();
  auto losses = cast_vec<T>(randn(N, 406));
  Tensor l = view(f.logits, {N, Vp});
  cross_entropy_forward_backward(f.ctx, view(losses, {N}), l, l, view(f.targets, {N}), V, f.dloss);
  expect_near(losses, r.losses, tol<T>(kTolF32), "losses");
  Vec got = to_f64(f.logits), want = r.dlogits;
  for (double& x : got) x /= f.dloss;
  for (double& x : want) x /= f.dloss;
  expect_near(got, want, tol<T>(kTolF32), "dlogits / dloss (aliased)");
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) ASSERT_EQ(f.logits[n * Vp + j], T(0)) << "padding dlogits[" << n << ", " << j << "]";
}

// Evaluation runs without a gradient: dlogits undefined, losses only, and
// the logits unchanged.
TYPED_TEST(CrossEntropyTest, LossesOnly) {
  using T = TypeParam;
  auto& f = *this;
  auto losses = cast_vec<T>(randn(f.N, 407));
  cross_entropy_forward_backward(f.ctx, view(losses, {f.N}), Tensor{}, view(f.logits, {f.N, f.Vp}),
                                 view(f.targets, {f.N}), f.V, f.dloss);
  expect_near(losses, f.reference().losses, tol<T>(kTolF32), "losses");
  EXPECT_EQ(f.logits, f.make_logits());
}

// Large logits (~1e3 apart) overflow a naive exp; the max-subtracted form
// must give finite, correct losses (the reference subtracts the max too).
TYPED_TEST(CrossEntropyTest, LargeLogitsStayFinite) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = 5, Vp = 128, V = 100;
  auto logits = cast_vec<T>(randn(N * Vp, 408, 300.0));
  auto targets = rand_int(N, 409, 0, int32_t(V));
  auto losses = cast_vec<T>(randn(N, 410));
  auto dlogits = cast_vec<T>(randn(N * Vp, 411));
  cross_entropy_forward_backward(f.ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(logits, {N, Vp}),
                                 view(targets, {N}), V, 1.0);
  CrossEntropyOut r = ref_cross_entropy(to_f64(logits), targets, N, Vp, V, 1.0);
  expect_near(losses, r.losses, tol<T>(kTolF32), "losses");
  expect_near(dlogits, r.dlogits, tol<T>(kTolF32), "dlogits");
}

// Central differences of L = dloss * sum(losses) in float64 against the F64
// kernel gradient, over every logit including the padding columns (whose
// true gradient is exactly zero). h = 1e-6; norm-wise bound 1e-6.
TEST(CrossEntropyGradCheck, FiniteDifferences) {
  const int64_t N = 7, Vp = 128, V = 100;
  const double h = 1e-6, dloss = 0.37;
  KernelContext ctx;
  Vec logits = randn(N * Vp, 421, 2.0);
  auto targets = rand_int(N, 422, 0, int32_t(V));
  Vec losses(N), dlogits(N * Vp);
  auto loss = [&]() {
    cross_entropy_forward_backward(ctx, view(losses, {N}), Tensor{}, view(logits, {N, Vp}), view(targets, {N}), V, dloss);
    double L = 0;
    for (double l : losses) L += dloss * l;
    return L;
  };
  cross_entropy_forward_backward(ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(logits, {N, Vp}),
                                 view(targets, {N}), V, dloss);
  EXPECT_LT(normwise_error(numeric_gradient(logits, h, loss), dlogits), 1e-6);
}

// A GPT-2-sized row (V = 50257, not a multiple of the kernel's 64-value
// blocks, padded to 50304) in F32, with two rows whose max grows in every
// block (the running per-lane max is rescaled again and again) and one whose
// max is the very last real column; losses and gradient against float64.
TEST(CrossEntropyLongRows, GptVocabularyAgainstReference) {
  const int64_t N = 6, Vp = 50304, V = 50257;
  KernelContext ctx;
  Vec l64 = randn(N * Vp, 431, 2.0);
  for (int64_t j = 0; j < V; ++j) {
    l64[j] = 0.001 * double(j);                   // rising: a new max in every block
    l64[Vp + j] = 40.0 * double(j) / double(V);   // rising steeply
  }
  l64[2 * Vp + V - 1] = 30.0;                     // the max in the tail block
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) l64[n * Vp + j] = 1e4;  // padding never enters
  std::vector<float> logits = cast_vec<float>(l64);
  auto targets = rand_int(N, 432, 0, int32_t(V));
  targets[2] = int32_t(V - 1);
  const double dloss = 0.25;
  std::vector<float> losses(N), dlogits(N * Vp);
  cross_entropy_forward_backward(ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(logits, {N, Vp}),
                                 view(targets, {N}), V, dloss);
  CrossEntropyOut r = ref_cross_entropy(to_f64(logits), targets, N, Vp, V, dloss);
  expect_near(losses, r.losses, tol<float>(kTolF32), "losses");
  Vec got = to_f64(dlogits), want = r.dlogits;
  for (double& x : got) x /= dloss;
  for (double& x : want) x /= dloss;
  expect_near(got, want, tol<float>(kTolF32), "dlogits / dloss");
}

// Each row's loss and gradient are the same bits whatever the thread count.
TEST(CrossEntropyDeterminism, IndependentOfThreadCount) {
  const int64_t N = 29, Vp = 1000, V = 997;
  KernelContext ctx;
  std::vector<float> logits = cast_vec<float>(randn(N * Vp, 441, 3.0));
  auto targets = rand_int(N, 442, 0, int32_t(V));
  const int saved = omp_get_max_threads();
  std::vector<float> losses[2], dlogits[2];
  for (int k = 0; k < 2; ++k) {
    omp_set_num_threads(k == 0 ? 1 : 3);
    losses[k].assign(N, 0.f);
    dlogits[k].assign(N * Vp, 0.f);
    cross_entropy_forward_backward(ctx, view(losses[k], {N}), view(dlogits[k], {N, Vp}), view(logits, {N, Vp}),
                                   view(targets, {N}), V, 0.5);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(dlogits[0], dlogits[1]);
}

TEST(CrossEntropyErrors, VocabWiderThanLogitsNamesTheOp) {
  KernelContext ctx;
  std::vector<float> logits(4 * 128), losses(4);
  std::vector<int32_t> targets(4, 1);
  expect_error([&] {
    cross_entropy_forward_backward(ctx, view(losses, {4}), Tensor{}, view(logits, {4, 128}), view(targets, {4}), 129,
                                   1.0);
  }, ErrorKind::Shape, {"cross_entropy"});
}

TEST(CrossEntropyErrors, WrongLossesShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> logits(4 * 128), losses(5);
  std::vector<int32_t> targets(4, 1);
  expect_error([&] {
    cross_entropy_forward_backward(ctx, view(losses, {5}), Tensor{}, view(logits, {4, 128}), view(targets, {4}), 100,
                                   1.0);
  }, ErrorKind::Shape, {"cross_entropy"});
}

// A target in the padding columns (or negative) is a data error naming the
// op: silently training towards a padding column would go unnoticed.
TEST(CrossEntropyErrors, TargetOutsideVocabularyIsADataError) {
  KernelContext ctx;
  std::vector<float> logits(4 * 128, 0.5f), losses(4);
  for (int32_t bad : {100, -1}) {
    std::vector<int32_t> targets = {1, 2, bad, 3};
    expect_error([&] {
      cross_entropy_forward_backward(ctx, view(losses, {4}), Tensor{}, view(logits, {4, 128}), view(targets, {4}), 100,
                                     1.0);
    }, ErrorKind::Data, {"cross_entropy", std::to_string(bad)});
  }
}

}  // namespace
}  // namespace xirang::test
