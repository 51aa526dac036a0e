// Tests for kernels/cross_entropy.h (softmax cross entropy over a padded
// vocabulary, fused with its gradient, and its three vocabulary-parallel
// phases) against the float64 reference in every storage type (f64, f32,
// bf16, f16: 16-bit logits keep F32 losses and row statistics), plus a
// finite-difference check of the F64 gradient.
//
// Tolerances, relative to max(1, max|ref|) (CrossEntropyTol below; dlogits
// are compared divided by dloss, so the bound is on O(1) softmax values):
// - f32: 1e-5. The loss is a log-sum-exp over V = 300 entries (relative
//   error ~1e-6 with the max subtracted); each gradient entry is one softmax
//   value minus the one-hot, times dloss. The sharded phases add two fp32
//   roundings of exp sums (cross_entropy_shard_test.cc), well inside.
// - f64: 1e-10, only the order of operations differs from the reference.
// - 16-bit (u = 2^-8 bf16, 2^-11 f16; logits rounded to the type first and
//   read back by the reference): losses and row statistics are formed in
//   double from exact inputs and stored in F32: the f32 tolerance. dlogits
//   are softmax values minus the one-hot, rounded once: 2u, >= 97% of them
//   the reference rounded once, and the target entries (p - 1) dloss must
//   equal the reference rounded once exactly (subtracting dloss from an
//   already rounded entry, a second rounding, misses often).
#include <omp.h>

#include <cmath>

#include "kernels/cross_entropy.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
struct CrossEntropyTol {
  static constexpr double loss = tol<StatType<T>>(kTolF32);  // losses, stored as F32 beside 16-bit logits
  static constexpr double grad = stored_tol<T>(kTolF32, 2);  // dlogits / dloss
  static constexpr double rounded = 0.97;                    // 16-bit: fraction rounded once
};

template <class T>
class CrossEntropyTest : public ::testing::Test {
 protected:
  using Tol = CrossEntropyTol<T>;
  using L = StatType<T>;
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
  // rows (off-by-one edges) and both sides of the shard boundary at 128.
  static std::vector<int32_t> make_targets() {
    auto t = rand_int(N, 403, 0, int32_t(V));
    t[0] = 0, t[N - 1] = int32_t(V - 1), t[1] = 127, t[2] = 128;
    return t;
  }
  CrossEntropyOut reference() const { return ref_cross_entropy(to_f64(logits), targets, N, Vp, V, dloss); }

  // dlogits (N, Vp) against the reference: divided by dloss (O(1) values,
  // so the tolerance is not 37x looser than it looks), exactly rounded
  // target entries for 16-bit, exact zeros in the padding.
  void check_dlogits(const std::vector<T>& d, const Vec& ref, const std::string& what) const {
    auto over_dloss = [&](Vec v) {
      for (double& x : v) x /= dloss;
      return v;
    };
    expect_near(over_dloss(to_f64(d)), over_dloss(ref), Tol::grad, what + " / dloss");
    if constexpr (is_16bit_v<T>) {
      expect_mostly_rounded(d, ref, Tol::rounded, what);
      for (int64_t n = 0; n < N; ++n) {
        const double r = ref[n * Vp + targets[n]];
        const double want = std::is_same_v<T, bf16> ? ref_round_bf16(r) : ref_round_f16(r);
        EXPECT_EQ(as_double(d[n * Vp + targets[n]]), want) << what << " target entry of row " << n;
      }
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = V; j < Vp; ++j)
        ASSERT_EQ(as_double(d[n * Vp + j]), 0.0) << what << " padding [" << n << ", " << j << "]";
  }
};
TYPED_TEST_SUITE(CrossEntropyTest, StorageTypes, StorageTypeNames);

// Losses and dlogits into separate buffers pre-filled with random values;
// the logits are inputs and stay untouched.
TYPED_TEST(CrossEntropyTest, LossesAndGradient) {
  using T = TypeParam;
  using L = StatType<T>;
  auto& f = *this;
  const int64_t N = f.N, Vp = f.Vp;
  auto losses = cast_vec<L>(randn(N, 404));
  auto dlogits = cast_vec<T>(randn(N * Vp, 405));
  cross_entropy_forward_backward(f.ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(f.logits, {N, Vp}),
                                 view(f.targets, {N}), f.V, f.dloss);
  CrossEntropyOut r = f.reference();
  expect_near(losses, r.losses, TestFixture::Tol::loss, "losses");
  f.check_dlogits(dlogits, r.dlogits, "dlogits");
  EXPECT_EQ(bytes_of(f.logits), bytes_of(f.make_logits())) << "the logits changed";
}

// dlogits aliasing logits: the gradient overwrites the logits in place (how
// the model avoids a second (N, Vp) buffer). The same losses and bytes as
// out of place.
TYPED_TEST(CrossEntropyTest, GradientInPlaceOverLogits) {
  using T = TypeParam;
  using L = StatType<T>;
  auto& f = *this;
  const int64_t N = f.N, Vp = f.Vp;
  CrossEntropyOut r = f.reference();
  auto losses = cast_vec<L>(randn(N, 404));
  auto dlogits = cast_vec<T>(randn(N * Vp, 405));
  cross_entropy_forward_backward(f.ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(f.logits, {N, Vp}),
                                 view(f.targets, {N}), f.V, f.dloss);
  auto in_place = cast_vec<L>(randn(N, 406));
  Tensor l = view(f.logits, {N, Vp});
  cross_entropy_forward_backward(f.ctx, view(in_place, {N}), l, l, view(f.targets, {N}), f.V, f.dloss);
  expect_near(in_place, r.losses, TestFixture::Tol::loss, "losses");
  f.check_dlogits(f.logits, r.dlogits, "dlogits (aliased)");
  EXPECT_EQ(bytes_of(in_place), bytes_of(losses)) << "losses differ in place";
  EXPECT_EQ(bytes_of(f.logits), bytes_of(dlogits)) << "dlogits differ in place";
}

// Evaluation runs without a gradient: dlogits undefined, losses only, and
// the logits unchanged.
TYPED_TEST(CrossEntropyTest, LossesOnly) {
  using T = TypeParam;
  auto& f = *this;
  auto losses = cast_vec<StatType<T>>(randn(f.N, 407));
  cross_entropy_forward_backward(f.ctx, view(losses, {f.N}), Tensor{}, view(f.logits, {f.N, f.Vp}),
                                 view(f.targets, {f.N}), f.V, f.dloss);
  expect_near(losses, f.reference().losses, TestFixture::Tol::loss, "losses");
  EXPECT_EQ(bytes_of(f.logits), bytes_of(f.make_logits())) << "the logits changed";
}

// Large logits (~1e3 apart) overflow a naive exp; the max-subtracted form
// must give finite, correct losses (the reference subtracts the max too).
TYPED_TEST(CrossEntropyTest, LargeLogitsStayFinite) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = 5, Vp = 128, V = 100;
  auto logits = cast_vec<T>(randn(N * Vp, 408, 300.0));
  auto targets = rand_int(N, 409, 0, int32_t(V));
  auto losses = cast_vec<StatType<T>>(randn(N, 410));
  auto dlogits = cast_vec<T>(randn(N * Vp, 411));
  cross_entropy_forward_backward(f.ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(logits, {N, Vp}),
                                 view(targets, {N}), V, 1.0);
  CrossEntropyOut r = ref_cross_entropy(to_f64(logits), targets, N, Vp, V, 1.0);
  expect_near(losses, r.losses, TestFixture::Tol::loss, "losses");
  expect_near(dlogits, r.dlogits, TestFixture::Tol::grad, "dlogits");
}

// The three vocabulary-parallel phases over 3 shards of 128 columns, with
// row_max and sums reduced here in shard order, as the model's all-reduces
// do; the shards' dlogits side by side are the fused op's.
TYPED_TEST(CrossEntropyTest, ShardedPhases) {
  using T = TypeParam;
  using St = StatType<T>;
  auto& f = *this;
  const int64_t N = f.N, Vp = f.Vp, tp = 3, w = Vp / tp;
  CrossEntropyOut r = f.reference();
  std::vector<std::vector<T>> shard(tp, std::vector<T>(N * w));
  for (int64_t s = 0; s < tp; ++s)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < w; ++j) shard[s][n * w + j] = f.logits[n * Vp + s * w + j];
  std::vector<St> row_max(N, St(-INFINITY)), sums(N * 2, St(0));
  for (int64_t s = 0; s < tp; ++s) {
    auto m = cast_vec<St>(randn(N, 1310 + s));
    cross_entropy_shard_max(f.ctx, view(m, {N}), view(shard[s], {N, w}), s * w, f.V);
    for (int64_t n = 0; n < N; ++n) row_max[n] = std::max(row_max[n], m[n]);
  }
  for (int64_t s = 0; s < tp; ++s) {
    auto part = cast_vec<St>(randn(N * 2, 1320 + s));
    cross_entropy_shard_sums(f.ctx, view(part, {N, 2}), view(shard[s], {N, w}), view(f.targets, {N}),
                             view(row_max, {N}), s * w, f.V);
    for (int64_t k = 0; k < N * 2; ++k) sums[k] += part[k];
  }
  std::vector<T> d(N * Vp);
  for (int64_t s = 0; s < tp; ++s) {
    auto losses = cast_vec<St>(randn(N, 1330 + s));
    cross_entropy_shard_finish(f.ctx, view(losses, {N}), view(shard[s], {N, w}), view(shard[s], {N, w}),
                               view(f.targets, {N}), view(row_max, {N}), view(sums, {N, 2}), s * w, f.V, f.dloss);
    expect_near(losses, r.losses, TestFixture::Tol::loss, "losses of shard " + std::to_string(s));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < w; ++j) d[n * Vp + s * w + j] = shard[s][n * w + j];
  }
  f.check_dlogits(d, r.dlogits, "sharded dlogits");
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

// Losses and row statistics are F32 beside 16-bit logits.
TEST(CrossEntropyErrors, StatisticsAreF32For16BitLogits) {
  KernelContext ctx;
  std::vector<bf16> logits(4 * 128), losses16(4), row_max16(4);
  std::vector<float> losses(4);
  std::vector<int32_t> targets = {1, 2, 3, 4};
  expect_error([&] {
    cross_entropy_forward_backward(ctx, view(losses16, {4}), Tensor{}, view(logits, {4, 128}), view(targets, {4}), 100,
                                   1.0);
  }, ErrorKind::Shape, {"cross_entropy", "losses", "f32"});
  expect_error([&] { cross_entropy_shard_max(ctx, view(row_max16, {4}), view(logits, {4, 128}), 0, 100); },
               ErrorKind::Shape, {"cross_entropy_shard_max", "row_max", "f32"});
}

}  // namespace
}  // namespace xirang::test
