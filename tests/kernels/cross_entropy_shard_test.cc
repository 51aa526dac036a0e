// Tests for the vocabulary-parallel cross entropy of kernels/cross_entropy.h
// (cross_entropy_shard_max / _sums / _finish). The logits are split by
// columns into tp shards, the three phases run per shard with the all-reduces
// (Max, then Sum) done here in shard order, and the losses and concatenated
// dlogits must match the fused cross_entropy_forward_backward and the float64
// reference.
//
// fp32 tolerance: 1e-5 of max(1, max|ref|), as for the fused kernel (see
// cross_entropy_test.cc). The sharded path adds two roundings the fused one
// lacks: each shard's exp sum and the reduced sum are stored in fp32 (6e-8
// relative each, ~1e-7 on the loss). It also differs in order: the fused
// kernel subtracts the max in fp32 (~1e-6 absolute on the exponent for the
// far tail, ~2e-7 for the terms that matter). All well inside 1e-5; dlogits
// are compared divided by dloss, so that bound is on O(1) softmax values.
#include <cmath>
#include <limits>

#include "kernels/cross_entropy.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
struct ShardedOut {
  std::vector<T> losses;   // (N), from shard 0 (every shard computes the same)
  std::vector<T> dlogits;  // (N, Vp), the shards' dlogits side by side
};

template <class T>
class CrossEntropyShardTest : public ::testing::Test {
 protected:
  static constexpr int64_t N = 29, V = 300;
  KernelContext ctx;
  const double dloss = 1.0 / double(N);
  // Random targets with the edges forced in: the first and last real column
  // and both sides of every shard boundary used below (96, 128, 192, 288).
  std::vector<int32_t> targets = [] {
    auto t = rand_int(N, 603, 0, int32_t(V));
    const int32_t edges[] = {0, int32_t(V - 1), 95, 96, 127, 128, 191, 192, 255, 256, 287, 288};
    for (size_t k = 0; k < std::size(edges); ++k) t[1 + 2 * k] = edges[k];
    return t;
  }();

  // (N, Vp): real columns of scale 3; padding columns around +1e4, which would
  // swamp the softmax (or underflow every real exp) if a shard let them in.
  static std::vector<T> make_logits(int64_t Vp) {
    Vec l = randn(N * Vp, 601, 3.0);
    Vec pad = randn(N * Vp, 602, 100.0, 1e4);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = V; j < Vp; ++j) l[n * Vp + j] = pad[n * Vp + j];
    return cast_vec<T>(l);
  }

  // Columns [begin, begin + width) of every row of the (N, Vp) logits.
  static std::vector<T> columns(const std::vector<T>& full, int64_t Vp, int64_t begin, int64_t width) {
    std::vector<T> s(N * width);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < width; ++j) s[n * width + j] = full[n * Vp + begin + j];
    return s;
  }

  // The three phases over tp equal shards of the (N, Vp) logits. With
  // in_place, each shard's dlogits overwrite its logits (as the model does).
  ShardedOut<T> run_sharded(const std::vector<T>& full, int64_t Vp, int tp, bool in_place) {
    const int64_t w = Vp / tp;
    std::vector<std::vector<T>> shard(tp);
    for (int s = 0; s < tp; ++s) shard[s] = columns(full, Vp, s * w, w);

    // Phase 1 and the Max all-reduce; -inf is its identity.
    std::vector<T> row_max(N, -std::numeric_limits<T>::infinity());
    for (int s = 0; s < tp; ++s) {
      auto m = cast_vec<T>(randn(N, 610 + s));
      cross_entropy_shard_max(ctx, view(m, {N}), view(shard[s], {N, w}), s * w, V);
      for (int64_t n = 0; n < N; ++n) row_max[n] = std::max(row_max[n], m[n]);
    }
    // Phase 2 and the Sum all-reduce, in T and in shard order as a
    // reduction in the tensor's dtype would add them.
    std::vector<T> sums(N * 2, T(0));
    for (int s = 0; s < tp; ++s) {
      auto part = cast_vec<T>(randn(N * 2, 620 + s));
      cross_entropy_shard_sums(ctx, view(part, {N, 2}), view(shard[s], {N, w}), view(targets, {N}), view(row_max, {N}),
                               s * w, V);
      for (int64_t k = 0; k < N * 2; ++k) sums[k] += part[k];
    }
    // Phase 3: every shard writes its own dlogits and the (identical) losses.
    ShardedOut<T> r{std::vector<T>(N), std::vector<T>(N * Vp)};
    for (int s = 0; s < tp; ++s) {
      auto losses = cast_vec<T>(randn(N, 630 + s));
      auto d = cast_vec<T>(randn(N * w, 640 + s));
      std::vector<T>& out = in_place ? shard[s] : d;
      cross_entropy_shard_finish(ctx, view(losses, {N}), view(out, {N, w}), view(shard[s], {N, w}), view(targets, {N}),
                                 view(row_max, {N}), view(sums, {N, 2}), s * w, V, dloss);
      if (s == 0) r.losses = losses;
      else EXPECT_EQ(losses, r.losses) << "shard " << s << " of " << tp << " computed other losses";
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < w; ++j) r.dlogits[n * Vp + s * w + j] = out[n * w + j];
    }
    return r;
  }

  // Sharded against fused against float64: losses, dlogits / dloss, and
  // exact zeros in the padding columns.
  void check(const ShardedOut<T>& got, const std::vector<T>& logits, int64_t Vp, const std::string& what) {
    auto losses = cast_vec<T>(randn(N, 650));
    auto dlogits = cast_vec<T>(randn(N * Vp, 651));
    auto fused_in = logits;
    cross_entropy_forward_backward(ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(fused_in, {N, Vp}),
                                   view(targets, {N}), V, dloss);
    CrossEntropyOut ref = ref_cross_entropy(to_f64(logits), targets, N, Vp, V, dloss);
    auto over_dloss = [&](Vec v) {
      for (double& x : v) x /= dloss;
      return v;
    };
    expect_near(got.losses, to_f64(losses), tol<T>(kTolF32), what + ": losses vs fused");
    expect_near(got.losses, ref.losses, tol<T>(kTolF32), what + ": losses vs reference");
    expect_near(over_dloss(to_f64(got.dlogits)), over_dloss(to_f64(dlogits)), tol<T>(kTolF32),
                what + ": dlogits / dloss vs fused");
    expect_near(over_dloss(to_f64(got.dlogits)), over_dloss(ref.dlogits), tol<T>(kTolF32),
                what + ": dlogits / dloss vs reference");
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = V; j < Vp; ++j)
        ASSERT_EQ(got.dlogits[n * Vp + j], T(0)) << what << ": padding dlogits[" << n << ", " << j << "]";
  }
};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(CrossEntropyShardTest, ComputeTypes);

// Vp = 384 split 1, 2, 3 and 4 ways: tp = 3 gives shards of 128 columns
// holding 128, 128 and 44 real ones; tp = 4 gives 96-column shards, the
// last (288..383) holding only 12 real columns.
TYPED_TEST(CrossEntropyShardTest, MatchesFusedForEveryTp) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t Vp = 384;
  const auto logits = f.make_logits(Vp);
  for (int tp : {1, 2, 3, 4}) {
    ShardedOut<T> got = f.run_sharded(logits, Vp, tp, /*in_place=*/false);
    f.check(got, logits, Vp, "tp=" + std::to_string(tp));
  }
}

// The gradient overwriting each shard's logits gives the same results.
TYPED_TEST(CrossEntropyShardTest, GradientInPlaceOverLogits) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t Vp = 384;
  const auto logits = f.make_logits(Vp);
  for (int tp : {1, 3, 4}) {
    ShardedOut<T> got = f.run_sharded(logits, Vp, tp, /*in_place=*/true);
    f.check(got, logits, Vp, "in place, tp=" + std::to_string(tp));
  }
}

// Vp = 512 in 4 shards of 128: the last shard (384..511) is all padding. Its
// max is -inf (the identity of Max), its sums exactly 0, its dlogits exactly
// 0, and the other shards still give the fused result.
TYPED_TEST(CrossEntropyShardTest, ShardOfPaddingOnly) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, Vp = 512, w = 128;
  const auto logits = f.make_logits(Vp);
  f.check(f.run_sharded(logits, Vp, 4, false), logits, Vp, "tp=4 with a padding shard");

  auto pad = f.columns(logits, Vp, 384, w);
  auto m = cast_vec<T>(randn(N, 660));
  cross_entropy_shard_max(f.ctx, view(m, {N}), view(pad, {N, w}), 384, f.V);
  for (int64_t n = 0; n < N; ++n) ASSERT_EQ(m[n], -std::numeric_limits<T>::infinity()) << "row_max[" << n << "]";
  auto row_max = cast_vec<T>(randn(N, 661, 3.0, 8.0));  // a finite global max, as after the all-reduce
  auto sums = cast_vec<T>(randn(N * 2, 662));
  cross_entropy_shard_sums(f.ctx, view(sums, {N, 2}), view(pad, {N, w}), view(f.targets, {N}), view(row_max, {N}), 384,
                           f.V);
  for (int64_t k = 0; k < N * 2; ++k) ASSERT_EQ(sums[k], T(0)) << "sums element " << k;
  auto global_sums = cast_vec<T>(randu(N * 2, 663, 1.0, 5.0));
  auto losses = cast_vec<T>(randn(N, 664));
  cross_entropy_shard_finish(f.ctx, view(losses, {N}), view(pad, {N, w}), view(pad, {N, w}), view(f.targets, {N}),
                             view(row_max, {N}), view(global_sums, {N, 2}), 384, f.V, f.dloss);
  for (int64_t k = 0; k < N * w; ++k) ASSERT_EQ(pad[k], T(0)) << "padding-shard dlogits element " << k;
  // Its losses come from the global row_max and sums alone.
  Vec want(N);
  for (int64_t n = 0; n < N; ++n)
    want[n] = std::log(double(global_sums[2 * n])) + double(row_max[n]) - double(global_sums[2 * n + 1]);
  expect_near(losses, want, tol<T>(1e-6), "padding-shard losses");  // a log and two adds in double, one fp32 rounding
}

// Evaluation: finish without dlogits gives the losses and leaves the logits alone.
TYPED_TEST(CrossEntropyShardTest, LossesOnly) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, Vp = 384;
  auto logits = f.make_logits(Vp);
  std::vector<T> row_max(N), sums(N * 2), losses = cast_vec<T>(randn(N, 670));
  cross_entropy_shard_max(f.ctx, view(row_max, {N}), view(logits, {N, Vp}), 0, f.V);
  cross_entropy_shard_sums(f.ctx, view(sums, {N, 2}), view(logits, {N, Vp}), view(f.targets, {N}), view(row_max, {N}),
                           0, f.V);
  cross_entropy_shard_finish(f.ctx, view(losses, {N}), Tensor{}, view(logits, {N, Vp}), view(f.targets, {N}),
                             view(row_max, {N}), view(sums, {N, 2}), 0, f.V, f.dloss);
  expect_near(losses, ref_cross_entropy(to_f64(logits), f.targets, N, Vp, f.V, f.dloss).losses, tol<T>(kTolF32),
              "losses");
  EXPECT_EQ(logits, f.make_logits(Vp));
}

// Targets are global ids: one in the padding (or negative) is a data error
// naming the phase and the value, even on a shard that does not hold it.
// The row max is exact: the largest real column wherever it sits (every
// position of a 45-column shard with 37 real columns: lanes of eight and the
// tail), the padding ignored. (The losses alone would not notice a smaller
// max: the softmax is shift invariant.)
TEST(CrossEntropyShardMax, ExactWhereverTheMaxSits) {
  KernelContext ctx;
  const int64_t w = 45, n_real = 37, N = n_real;
  std::vector<float> logits = cast_vec<float>(randn(N * w, 451));
  for (int64_t i = 0; i < N; ++i) {
    logits[i * w + i] = 9.5f + 0.01f * float(i);        // row i's max at column i
    for (int64_t j = n_real; j < w; ++j) logits[i * w + j] = 50.f;  // padding
  }
  std::vector<float> m(N);
  cross_entropy_shard_max(ctx, view(m, {N}), view(logits, {N, w}), 100, 100 + n_real);
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(m[i], 9.5f + 0.01f * float(i)) << "row " << i;
}

TEST(CrossEntropyShardErrors, TargetOutsideVocabularyIsADataError) {
  KernelContext ctx;
  std::vector<float> logits(4 * 128, 0.5f), row_max(4, 0.5f), sums(4 * 2, 1.0f), losses(4);
  for (int32_t bad : {300, -1}) {
    std::vector<int32_t> targets = {1, 2, bad, 3};
    expect_error([&] {
      cross_entropy_shard_sums(ctx, view(sums, {4, 2}), view(logits, {4, 128}), view(targets, {4}),
                               view(row_max, {4}), 128, 300);
    }, ErrorKind::Data, {"cross_entropy_shard_sums", std::to_string(bad), "position 2"});
    expect_error([&] {
      cross_entropy_shard_finish(ctx, view(losses, {4}), Tensor{}, view(logits, {4, 128}), view(targets, {4}),
                                 view(row_max, {4}), view(sums, {4, 2}), 128, 300, 1.0);
    }, ErrorKind::Data, {"cross_entropy_shard_finish", std::to_string(bad)});
  }
}

TEST(CrossEntropyShardErrors, ShapesAndArgumentsNameTheOp) {
  KernelContext ctx;
  std::vector<float> logits(4 * 128, 0.5f), row_max(4), row_max5(5), sums(4 * 2), sums3(4 * 3), losses(4);
  std::vector<double> row_max_f64(4);
  std::vector<int32_t> targets = {1, 2, 3, 4};
  expect_error([&] { cross_entropy_shard_max(ctx, view(row_max5, {5}), view(logits, {4, 128}), 0, 100); },
               ErrorKind::Shape, {"cross_entropy_shard_max", "row_max"});
  expect_error([&] { cross_entropy_shard_max(ctx, view(row_max_f64, {4}), view(logits, {4, 128}), 0, 100); },
               ErrorKind::Shape, {"cross_entropy_shard_max", "row_max", "f64"});
  expect_error([&] { cross_entropy_shard_max(ctx, view(row_max, {4}), view(logits, {4, 128}), -128, 100); },
               ErrorKind::Shape, {"cross_entropy_shard_max", "vocab_begin"});
  expect_error([&] {
    cross_entropy_shard_sums(ctx, view(sums3, {4, 3}), view(logits, {4, 128}), view(targets, {4}), view(row_max, {4}),
                             0, 100);
  }, ErrorKind::Shape, {"cross_entropy_shard_sums", "sums"});
  std::vector<float> dlogits(4 * 127);
  expect_error([&] {
    cross_entropy_shard_finish(ctx, view(losses, {4}), view(dlogits, {4, 127}), view(logits, {4, 128}),
                               view(targets, {4}), view(row_max, {4}), view(sums, {4, 2}), 0, 100, 1.0);
  }, ErrorKind::Shape, {"cross_entropy_shard_finish"});
}

}  // namespace
}  // namespace xirang::test
