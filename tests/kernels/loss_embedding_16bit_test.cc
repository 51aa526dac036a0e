// Tests for kernels/cross_entropy.h and kernels/embedding.h with BF16 and F16
// storage: F32 losses and row statistics, 16-bit gradients rounded once, and
// embedding gradients in 16 bits or F32.
//
// Tolerances (u = 2^-8 for bf16, 2^-11 for f16; inputs are rounded to S
// first and the float64 reference reads those values):
// - losses and row statistics are formed in double from exact inputs and
//   stored in F32: 1e-5, the fp32 tolerance of cross_entropy_test.cc;
// - dlogits / dloss are softmax values minus the one-hot, rounded once: 2u of
//   their O(1) scale, and the target entries (p - 1) dloss must equal the
//   reference rounded once exactly (subtracting dloss from an already rounded
//   entry, a second rounding, misses often);
// - embedding outputs are one float addition rounded once: 2u; 16-bit table
//   gradients are (prior + sum in double) rounded once: 2u, with >= 97% of
//   elements exactly rounded even for rows that collect ~70 contributions
//   (adding them one by one in 16 bits would not be); F32 table gradients
//   are the double sum rounded to float: 1e-6, as in embedding_test.cc.
#include <cmath>

#include "kernels/cross_entropy.h"
#include "kernels/embedding.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class S>
class Loss16Test : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, Vp = 384, V = 300;
  static constexpr double kTol = 2 * unit_roundoff<S>();
  KernelContext ctx;
  const double dloss = 1.0 / double(N);
  std::vector<S> logits = [] {
    Vec l = randn(N * Vp, 1301, 3.0);
    Vec pad = randn(N * Vp, 1302, 100.0, 1e4);  // padding columns that would swamp the softmax
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = V; j < Vp; ++j) l[n * Vp + j] = pad[n * Vp + j];
    return cast_vec<S>(l);
  }();
  std::vector<int32_t> targets = [] {
    auto t = rand_int(N, 1303, 0, int32_t(V));
    t[0] = 0, t[N - 1] = int32_t(V - 1), t[1] = 127, t[2] = 128;
    return t;
  }();

  CrossEntropyOut reference() const { return ref_cross_entropy(to_f64(logits), targets, N, Vp, V, dloss); }

  Vec over_dloss(Vec v) const {
    for (double& x : v) x /= dloss;
    return v;
  }

  // dlogits (N, Vp) against the reference: scaled tolerance, exact targets,
  // exact zeros in the padding.
  void check_dlogits(const std::vector<S>& d, const Vec& ref, const std::string& what) {
    expect_near(over_dloss(to_f64(d)), over_dloss(ref), kTol, what + " / dloss");
    expect_mostly_rounded(d, ref, 0.97, what);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = targets[n];
      const double want = std::is_same_v<S, bf16> ? ref_round_bf16(ref[n * Vp + t]) : ref_round_f16(ref[n * Vp + t]);
      EXPECT_EQ(as_double(d[n * Vp + t]), want) << what << " target entry of row " << n;
      for (int64_t j = V; j < Vp; ++j) ASSERT_EQ(as_double(d[n * Vp + j]), 0.0) << what << " padding [" << n << ", " << j << "]";
    }
  }
};
using Storage16 = ::testing::Types<bf16, f16>;
TYPED_TEST_SUITE(Loss16Test, Storage16);

// Fused: F32 losses, 16-bit dlogits, separately and in place over the logits.
TYPED_TEST(Loss16Test, FusedLossesAndGradient) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, Vp = f.Vp;
  CrossEntropyOut r = f.reference();
  auto losses = cast_vec<float>(randn(N, 1304));
  auto dlogits = cast_vec<S>(randn(N * Vp, 1305));
  cross_entropy_forward_backward(f.ctx, view(losses, {N}), view(dlogits, {N, Vp}), view(f.logits, {N, Vp}),
                                 view(f.targets, {N}), f.V, f.dloss);
  expect_near(losses, r.losses, kTolF32, "losses (f32)");
  f.check_dlogits(dlogits, r.dlogits, "dlogits");
  auto in_place = f.logits;
  auto losses2 = cast_vec<float>(randn(N, 1306));
  Tensor l = view(in_place, {N, Vp});
  cross_entropy_forward_backward(f.ctx, view(losses2, {N}), l, l, view(f.targets, {N}), f.V, f.dloss);
  EXPECT_EQ(losses2, losses);
  EXPECT_EQ(bytes_of(in_place), bytes_of(dlogits)) << "in place differs";
}

// The three vocabulary-parallel phases over 3 shards of 128 columns, with
// F32 row_max and sums reduced here in shard order, as the model's
// all-reduces do.
TYPED_TEST(Loss16Test, ShardedPhases) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, Vp = f.Vp, tp = 3, w = Vp / tp;
  CrossEntropyOut r = f.reference();
  std::vector<std::vector<S>> shard(tp, std::vector<S>(N * w));
  for (int64_t s = 0; s < tp; ++s)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < w; ++j) shard[s][n * w + j] = f.logits[n * Vp + s * w + j];
  std::vector<float> row_max(N, -INFINITY), sums(N * 2, 0.0f);
  for (int64_t s = 0; s < tp; ++s) {
    auto m = cast_vec<float>(randn(N, 1310 + s));
    cross_entropy_shard_max(f.ctx, view(m, {N}), view(shard[s], {N, w}), s * w, f.V);
    for (int64_t n = 0; n < N; ++n) row_max[n] = std::max(row_max[n], m[n]);
  }
  for (int64_t s = 0; s < tp; ++s) {
    auto part = cast_vec<float>(randn(N * 2, 1320 + s));
    cross_entropy_shard_sums(f.ctx, view(part, {N, 2}), view(shard[s], {N, w}), view(f.targets, {N}),
                             view(row_max, {N}), s * w, f.V);
    for (int64_t k = 0; k < N * 2; ++k) sums[k] += part[k];
  }
  std::vector<S> d(N * Vp);
  for (int64_t s = 0; s < tp; ++s) {
    auto losses = cast_vec<float>(randn(N, 1330 + s));
    cross_entropy_shard_finish(f.ctx, view(losses, {N}), view(shard[s], {N, w}), view(shard[s], {N, w}),
                               view(f.targets, {N}), view(row_max, {N}), view(sums, {N, 2}), s * w, f.V, f.dloss);
    expect_near(losses, r.losses, kTolF32, "losses of shard " + std::to_string(s));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < w; ++j) d[n * Vp + s * w + j] = shard[s][n * w + j];
  }
  f.check_dlogits(d, r.dlogits, "sharded dlogits");
}

TEST(Loss16Errors, StatisticsAreF32) {
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

// ---------------------------------------------------------------- embedding

template <class S>
class Embedding16Test : public ::testing::Test {
 protected:
  // 210 tokens over V = 5 ids (~42 per row, ~70 for the forced one); B = 3
  // sequences of T = 70, so each position collects 3 rows.
  static constexpr int64_t B = 3, T_ = 70, N = B * T_, C = 37, V = 5, MaxT = 72;
  static constexpr double kTol = 2 * unit_roundoff<S>();
  KernelContext ctx;
  std::vector<int32_t> tokens = [] {
    auto t = rand_int(N, 1401, 0, int32_t(V));
    for (int64_t i = 0; i < N; i += 7) t[i] = 2;
    return t;
  }();
  std::vector<S> wte = cast_vec<S>(randn(V * C, 1402));
  std::vector<S> wpe = cast_vec<S>(randn(MaxT * C, 1403));
  std::vector<S> dout = cast_vec<S>(randn(N * C, 1404));
};
TYPED_TEST_SUITE(Embedding16Test, Storage16);

TYPED_TEST(Embedding16Test, Forward) {
  using S = TypeParam;
  auto& f = *this;
  auto out = cast_vec<S>(randn(f.N * f.C, 1405));
  embedding_forward(f.ctx, view(out, {f.B, f.T_, f.C}), view(f.tokens, {f.B, f.T_}), view(f.wte, {f.V, f.C}),
                    view(f.wpe, {f.MaxT, f.C}));
  Vec ref = ref_embedding_forward(f.tokens, to_f64(f.wte), to_f64(f.wpe), f.B, f.T_, f.C);
  expect_near(out, ref, f.kTol, "out");
  expect_mostly_rounded(out, ref, 0.99, "out");
  // The lookup alone is a copy: exact.
  auto rows = cast_vec<S>(randn(f.N * f.C, 1406));
  embedding_lookup(f.ctx, view(rows, {f.N, f.C}), view(f.tokens, {f.N}), view(f.wte, {f.V, f.C}), 0, f.V);
  expect_near(rows, ref_embedding_lookup(f.tokens, to_f64(f.wte), 0, f.V, f.C), 0.0, "lookup");
}

// Gradients of both tables in S and in F32, accumulating onto prior values.
TYPED_TEST(Embedding16Test, BackwardSameDtypeAndF32) {
  using S = TypeParam;
  auto& f = *this;
  Vec zero_wte(f.V * f.C, 0.0), zero_wpe(f.MaxT * f.C, 0.0);
  ref_embedding_backward(zero_wte, zero_wpe, to_f64(f.dout), f.tokens, f.B, f.T_, f.C);
  {
    auto dwte = cast_vec<S>(randn(f.V * f.C, 1407));
    auto dwpe = cast_vec<S>(randn(f.MaxT * f.C, 1408));
    Vec want_te = plus(to_f64(dwte), zero_wte), want_pe = plus(to_f64(dwpe), zero_wpe);
    embedding_backward(f.ctx, view(dwte, {f.V, f.C}), view(dwpe, {f.MaxT, f.C}), view(f.dout, {f.B, f.T_, f.C}),
                       view(f.tokens, {f.B, f.T_}));
    expect_near(dwte, want_te, f.kTol, "dwte");
    expect_mostly_rounded(dwte, want_te, 0.97, "dwte");
    expect_near(dwpe, want_pe, f.kTol, "dwpe");
    expect_mostly_rounded(dwpe, want_pe, 0.97, "dwpe");
  }
  {
    auto dwte = cast_vec<float>(randn(f.V * f.C, 1409));
    auto dwpe = cast_vec<float>(randn(f.MaxT * f.C, 1410));
    Vec want_te = plus(to_f64(dwte), zero_wte), want_pe = plus(to_f64(dwpe), zero_wpe);
    embedding_backward(f.ctx, view(dwte, {f.V, f.C}), view(dwpe, {f.MaxT, f.C}), view(f.dout, {f.B, f.T_, f.C}),
                       view(f.tokens, {f.B, f.T_}));
    // Sums of ~70 unit values: scale ~10, so 1e-6 of it is far above the
    // one fp32 rounding (6e-8) the double sum gets.
    expect_near(dwte, want_te, 1e-6, "f32 dwte");
    expect_near(dwpe, want_pe, 1e-6, "f32 dwpe");
  }
}

// Sharded lookup backward and positions from an offset (sequence
// parallelism): the shards' F32 gradients are slices of the full one,
// bitwise, and positions over runs of rows match one call.
TYPED_TEST(Embedding16Test, ShardsAndRowRuns) {
  using S = TypeParam;
  auto& f = *this;
  auto full = cast_vec<float>(randn(f.V * f.C, 1411));
  auto prior = full;
  embedding_lookup_backward(f.ctx, view(full, {f.V, f.C}), view(f.dout, {f.N, f.C}), view(f.tokens, {f.N}), 0, f.V);
  for (auto [begin, rows] : {std::pair<int64_t, int64_t>{0, 2}, {2, 3}}) {
    std::vector<float> shard(prior.begin() + begin * f.C, prior.begin() + (begin + rows) * f.C);
    embedding_lookup_backward(f.ctx, view(shard, {rows, f.C}), view(f.dout, {f.N, f.C}), view(f.tokens, {f.N}), begin,
                              f.V);
    EXPECT_EQ(shard, std::vector<float>(full.begin() + begin * f.C, full.begin() + (begin + rows) * f.C))
        << "shard at " << begin;
  }
  // add_positions over rows [5, 5 + 31) of sequences of 13 against the reference.
  const int64_t n = 31, seq = 13, off = 5;
  auto x = cast_vec<S>(randn(n * f.C, 1412));
  Vec want = ref_add_positions(to_f64(x), to_f64(f.wpe), n, f.C, seq, off);
  add_positions(f.ctx, view(x, {n, f.C}), view(f.wpe, {f.MaxT, f.C}), seq, off);
  expect_near(x, want, f.kTol, "add_positions");
  auto dwpe = cast_vec<S>(randn(f.MaxT * f.C, 1413));
  Vec want_pe = to_f64(dwpe);
  Vec dx = to_f64(std::vector<S>(f.dout.begin(), f.dout.begin() + n * f.C));
  ref_add_positions_backward(want_pe, dx, n, f.C, seq, off);
  add_positions_backward(f.ctx, view(dwpe, {f.MaxT, f.C}), view(f.dout, {f.N, f.C}).slice(0, n), seq, off);
  expect_near(dwpe, want_pe, f.kTol, "add_positions_backward");
  expect_mostly_rounded(dwpe, want_pe, 0.97, "add_positions_backward");
}

TEST(Embedding16Errors, GradientDtypes) {
  KernelContext ctx;
  std::vector<int32_t> tokens = {1, 2, 3, 0};
  std::vector<bf16> dout(4 * 8);
  std::vector<f16> dwte_f16(5 * 8);
  std::vector<float> dwte(5 * 8), dwpe(4 * 8), dout32(4 * 8);
  std::vector<bf16> dwte16(5 * 8);
  expect_error([&] {
    embedding_backward(ctx, view(dwte_f16, {5, 8}), view(dwpe, {4, 8}), view(dout, {1, 4, 8}), view(tokens, {1, 4}));
  }, ErrorKind::Shape, {"embedding_backward", "dwte", "f16"});
  expect_error([&] {
    embedding_lookup_backward(ctx, view(dwte16, {5, 8}), view(dout32, {4, 8}), view(tokens, {4}), 0, 5);
  }, ErrorKind::Shape, {"embedding_lookup_backward", "dwte", "bf16"});
}

}  // namespace
}  // namespace xirang::test
