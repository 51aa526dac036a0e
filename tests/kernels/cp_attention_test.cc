// Tests for kernels/cp_attention.h: the context-parallel attention of every
// rank of a cp group, assembled, against flash attention over the whole
// sequence (kernels/attention.h), over the storage types, head-tail and
// contiguous splits, c = 1, 2 and 4 and MHA, GQA and MQA head layouts.
//
// The harness plays the whole group in one process: it cuts the sequence's
// qkv rows by ContextSplit into each rank's local qkv, packs each rank's kv
// (kv_pack) and concatenates them into kv_all (the all-gather), runs each
// rank's forward and backward, sums the ranks' dkv_all (the reduce-scatter,
// here in double, rounded once) and unpacks each rank's block into its dqkv
// (kv_unpack); then it puts every rank's rows back at their positions.
//
// Tolerances, relative to max(1, max |reference|):
// - f64 against f64 flash: the same sums, except that dk and dv of a key are
//   summed over ranks in another order: 1e-12. With c = 1 the operations are
//   the flash pair's own: bit for bit.
// - f32 against f32 flash (the blocked path there, row-at-a-time here: two
//   fp32 computations of the same values): 1e-5, as flash_attention_test.
// - bf16, f16 against f64 flash on the same (rounded) inputs: out is formed
//   in float and rounded once (2u, as the flash pair); dq as the flash pair
//   (4u, see flash_attention_test); dk and dv are each rank's partial sum
//   rounded once to the storage type, then the ranks' partials summed and
//   rounded once more: each of the c partials moves by u of at most the
//   scale, so (4 + c)u.
#include <omp.h>

#include <cmath>
#include <string>

#include "kernels/attention.h"
#include "kernels/context_split.h"
#include "kernels/cp_attention.h"
#include "tests/kernels/cp_rows.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

template <class S>
struct CpRun {
  std::vector<S> out, dqkv;
  std::vector<StatType<S>> lse;
};

// The whole group on the sequence's qkv and dout; outputs in the sequence's
// layout (out (B, T, C), lse (B, H, T), dqkv (B, T, W)).
template <class S>
CpRun<S> run_cp(const std::vector<S>& qkv, const std::vector<S>& dout, const CpShape& a) {
  KernelContext ctx;
  const ContextSplit split = a.split();
  const int64_t Tl = split.local_rows(), H = a.H, KV = a.KV;
  const int c = a.c;
  CpRun<S> r{std::vector<S>(qkv.size() / a.W() * a.C()), std::vector<S>(qkv.size()),
           std::vector<StatType<S>>(size_t(a.B * a.H * a.T))};
  std::vector<std::vector<S>> q(c), kv(c), o(c), dq(c), dkv_all(c);
  std::vector<std::vector<StatType<S>>> lse(c);
  std::vector<S> kv_all;
  for (int k = 0; k < c; ++k) {
    q[k] = local_rows(qkv, a, a.W(), k);
    kv[k] = cast_vec<S>(randn(size_t(a.B * Tl * a.KVW()), 2101 + k));
    kv_pack(ctx, view(kv[k], {a.B, Tl, a.KVW()}), view(q[k], {a.B, Tl, a.W()}), int(H), int(KV));
    kv_all.insert(kv_all.end(), kv[k].begin(), kv[k].end());
  }
  Tensor kv_all_t = view(kv_all, {c, a.B, Tl, a.KVW()});
  std::vector<double> dkv_sum(kv_all.size(), 0.0);
  for (int k = 0; k < c; ++k) {
    o[k] = cast_vec<S>(randn(size_t(a.B * Tl * a.C()), 2111 + k));
    lse[k] = cast_vec<StatType<S>>(randn(size_t(a.B * H * Tl), 2121 + k));
    dq[k] = cast_vec<S>(randn(q[k].size(), 2131 + k));
    dkv_all[k] = cast_vec<S>(randn(kv_all.size(), 2141 + k));
    auto d = local_rows(dout, a, a.C(), k);
    Tensor qt = view(q[k], {a.B, Tl, a.W()}), ot = view(o[k], {a.B, Tl, a.C()}), lt = view(lse[k], {a.B, H, Tl});
    cp_attention_forward(ctx, ot, lt, qt, kv_all_t, split, k, int(H), int(KV));
    const std::vector<S> dq_before = dq[k];
    cp_attention_backward(ctx, view(dq[k], {a.B, Tl, a.W()}), view(dkv_all[k], {c, a.B, Tl, a.KVW()}),
                          view(d, {a.B, Tl, a.C()}), qt, kv_all_t, ot, lt, split, k, int(H), int(KV));
    // Backward leaves dqkv's k and v columns alone (kv_unpack writes them).
    for (int64_t row = 0; row < a.B * Tl; ++row)
      for (int64_t j = a.C(); j < a.W(); ++j)
        EXPECT_EQ(as_double(dq[k][row * a.W() + j]), as_double(dq_before[row * a.W() + j])) << "rank " << k;
    for (size_t i = 0; i < dkv_sum.size(); ++i) dkv_sum[i] += as_double(dkv_all[k][i]);
  }
  const std::vector<S> dkv = cast_vec<S>(dkv_sum);
  for (int k = 0; k < c; ++k) {
    std::vector<S> mine(dkv.begin() + k * a.B * Tl * a.KVW(), dkv.begin() + (k + 1) * a.B * Tl * a.KVW());
    kv_unpack(ctx, view(dq[k], {a.B, Tl, a.W()}), view(mine, {a.B, Tl, a.KVW()}), int(H), int(KV));
    put_rows(r.out, o[k], a, a.C(), k);
    put_rows(r.dqkv, dq[k], a, a.W(), k);
    for (int64_t bh = 0; bh < a.B * H; ++bh)
      for (int64_t t = 0; t < Tl; ++t) r.lse[bh * a.T + split.position(k, t)] = lse[k][bh * Tl + t];
  }
  return r;
}

// Flash attention over the whole sequence.
template <class S>
CpRun<S> run_flash(const std::vector<S>& qkv_in, const std::vector<S>& dout_in, const CpShape& a) {
  KernelContext ctx;
  auto qkv = qkv_in, dout = dout_in;
  CpRun<S> r{std::vector<S>(size_t(a.B * a.T * a.C())), std::vector<S>(qkv.size()),
           std::vector<StatType<S>>(size_t(a.B * a.H * a.T))};
  Tensor q = view(qkv, {a.B, a.T, a.W()}), o = view(r.out, {a.B, a.T, a.C()}), l = view(r.lse, {a.B, a.H, a.T});
  flash_attention_forward(ctx, o, l, q, int(a.H), int(a.KV));
  flash_attention_backward(ctx, view(r.dqkv, {a.B, a.T, a.W()}), view(dout, {a.B, a.T, a.C()}), q, o, l, int(a.H),
                           int(a.KV));
  return r;
}

// B = 2, H = 4, KV in {4, 2, 1}, chunks of 5 .. 16 tokens, both splits, c = 2 and 4.
std::vector<CpShape> group_shapes() {
  std::vector<CpShape> v;
  int i = 0;
  for (int c : {2, 4})
    for (bool ht : {true, false})
      for (int64_t kv : {4, 2, 1}) {
        const int64_t L = 5 + (7 * i++) % 12, D = i % 2 ? 8 : 16;
        v.push_back({2, 2 * c * L, 4, kv, D, c, ht});
      }
  return v;
}

template <class T>
class CpAttentionTest : public ::testing::Test {};
TYPED_TEST_SUITE(CpAttentionTest, StorageTypes, StorageTypeNames);

// Wide types: every rank's rows of out, lse and the assembled dqkv against
// flash attention of the same type on the whole sequence.
TYPED_TEST(CpAttentionTest, GroupEqualsWholeSequenceFlash) {
  using T = TypeParam;
  if constexpr (!is_16bit_v<T>) {
    const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-5;
    for (const CpShape& a : group_shapes()) {
      SCOPED_TRACE(a.str());
      auto qkv = cast_vec<T>(randn(size_t(a.B * a.T * a.W()), 2201 + a.T));
      auto dout = cast_vec<T>(randn(size_t(a.B * a.T * a.C()), 2202 + a.T));
      CpRun<T> got = run_cp(qkv, dout, a), want = run_flash(qkv, dout, a);
      expect_near(got.out, to_f64(want.out), tol, "out");
      expect_near(got.lse, to_f64(want.lse), tol, "lse");
      expect_near(got.dqkv, to_f64(want.dqkv), tol, "dqkv");
    }
  } else {
    GTEST_SKIP() << "16-bit storage: SixteenBitAgainstFloat64";
  }
}

// 16-bit storage: against f64 flash on the same rounded inputs (tolerances
// in the file comment); out also mostly the reference rounded once.
TYPED_TEST(CpAttentionTest, SixteenBitAgainstFloat64) {
  using T = TypeParam;
  if constexpr (is_16bit_v<T>) {
    const double u = unit_roundoff<T>();
    for (const CpShape& a : group_shapes()) {
      SCOPED_TRACE(a.str());
      auto qkv = cast_vec<T>(randn(size_t(a.B * a.T * a.W()), 2301 + a.T));
      auto dout = cast_vec<T>(randn(size_t(a.B * a.T * a.C()), 2302 + a.T));
      CpRun<T> got = run_cp(qkv, dout, a);
      CpRun<double> want = run_flash(to_f64(qkv), to_f64(dout), a);
      expect_stored(got.out, want.out, 2 * u, 0.97, "out");
      expect_near(got.lse, want.lse, 1e-5, "lse");
      expect_near(got.dqkv, want.dqkv, (4 + a.c) * u, "dqkv");
    }
  } else {
    GTEST_SKIP() << "wide storage: GroupEqualsWholeSequenceFlash";
  }
}

// One rank is flash attention over the whole sequence, bit for bit (the
// f64 row loops are the flash pair's; the float types' flash runs the
// blocked path, so only f64 is compared bitwise).
TYPED_TEST(CpAttentionTest, OneRankIsFlashBitForBit) {
  using T = TypeParam;
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t kv : {4, 2}) {
      const CpShape a{2, 13, 4, kv, 8, 1, true};
      auto qkv = randn(size_t(a.B * a.T * a.W()), 2401), dout = randn(size_t(a.B * a.T * a.C()), 2402);
      CpRun<double> got = run_cp(qkv, dout, a), want = run_flash(qkv, dout, a);
      EXPECT_EQ(bytes_of(got.out), bytes_of(want.out)) << "KV " << kv;
      EXPECT_EQ(bytes_of(got.lse), bytes_of(want.lse)) << "KV " << kv;
      EXPECT_EQ(bytes_of(got.dqkv), bytes_of(want.dqkv)) << "KV " << kv;
    }
  } else {
    GTEST_SKIP() << "f64 only: the float flash pair runs the blocked path";
  }
}

// The blocked float path (kernels/cpu/cp_attention_blocked.cc) on chunks
// that cross its 32-row query blocks and are not multiples of 8 or 16
// (L = 37, 70), odd and wide head sizes, every head grouping, c = 2 and 4,
// both splits: against f64 flash on the same (rounded) inputs. f32: 1e-5
// as GroupEqualsWholeSequenceFlash; 16-bit as SixteenBitAgainstFloat64.
TYPED_TEST(CpAttentionTest, BlockedPathOnLongChunksAgainstFloat64) {
  using T = TypeParam;
  if constexpr (!std::is_same_v<T, double>) {
    const double u = is_16bit_v<T> ? unit_roundoff<T>() : 0;
    int i = 0;
    for (int c : {2, 4})
      for (bool ht : {true, false})
        for (int64_t kv : {4, 2, 1}) {
          const int64_t L = i % 2 ? 70 : 37, D = i % 3 == 0 ? 20 : i % 3 == 1 ? 64 : 8;
          ++i;
          const CpShape a{1, 2 * c * L, 4, kv, D, c, ht};
          SCOPED_TRACE(a.str());
          auto qkv = cast_vec<T>(randn(size_t(a.B * a.T * a.W()), 2701 + i));
          auto dout = cast_vec<T>(randn(size_t(a.B * a.T * a.C()), 2702 + i));
          CpRun<T> got = run_cp(qkv, dout, a);
          CpRun<double> want = run_flash(to_f64(qkv), to_f64(dout), a);
          if constexpr (is_16bit_v<T>) {
            expect_stored(got.out, want.out, 2 * u, 0.97, "out");
            expect_near(got.lse, want.lse, 1e-5, "lse");
            expect_near(got.dqkv, want.dqkv, (4 + a.c) * u, "dqkv");
          } else {
            expect_near(got.out, want.out, 1e-5, "out");
            expect_near(got.lse, want.lse, 1e-5, "lse");
            expect_near(got.dqkv, want.dqkv, 1e-5, "dqkv");
          }
        }
  } else {
    GTEST_SKIP() << "f64 runs the row loops: GroupEqualsWholeSequenceFlash";
  }
}

// With float compute and c = 1 the cp pair's blocks, products and sums are
// the one-rank blocked flash pair's (one chunk of T: blocks start at
// multiples of 32 in both), so the results are bit for bit equal, also for
// T not a multiple of the block or of 16. At T = 1100 the cp pair cuts each
// block's keys into pieces of 512 and the flash pair does not: the chains
// continued across pieces must give the same bits.
TYPED_TEST(CpAttentionTest, OneRankBlockedIsFlashBitForBit) {
  using T = TypeParam;
  if constexpr (!std::is_same_v<T, double>) {
    for (int64_t t : {45, 64, 1100})
      for (int64_t kv : {4, 1}) {
        const CpShape a{2, t, 4, kv, 20, 1, true};
        SCOPED_TRACE(a.str());
        auto qkv = cast_vec<T>(randn(size_t(a.B * a.T * a.W()), 2801));
        auto dout = cast_vec<T>(randn(size_t(a.B * a.T * a.C()), 2802));
        CpRun<T> got = run_cp(qkv, dout, a), want = run_flash(qkv, dout, a);
        EXPECT_EQ(bytes_of(got.out), bytes_of(want.out));
        EXPECT_EQ(bytes_of(got.lse), bytes_of(want.lse));
        EXPECT_EQ(bytes_of(got.dqkv), bytes_of(want.dqkv));
      }
  } else {
    GTEST_SKIP() << "f64: OneRankIsFlashBitForBit";
  }
}

// Results do not depend on the thread count (one task per (batch, head)
// forward, per (batch, key/value head) backward).
TYPED_TEST(CpAttentionTest, IndependentOfThreadCount) {
  using T = TypeParam;
  const CpShape a{2, 48, 4, 2, 16, 4, true};
  auto qkv = cast_vec<T>(randn(size_t(a.B * a.T * a.W()), 2501));
  auto dout = cast_vec<T>(randn(size_t(a.B * a.T * a.C()), 2502));
  const int saved = omp_get_max_threads();
  std::vector<CpRun<T>> runs;
  for (int threads : {1, 3, 4}) {
    omp_set_num_threads(threads);
    runs.push_back(run_cp(qkv, dout, a));
  }
  omp_set_num_threads(saved);
  for (int i : {1, 2}) {
    EXPECT_EQ(bytes_of(runs[i].out), bytes_of(runs[0].out)) << "run " << i;
    EXPECT_EQ(bytes_of(runs[i].lse), bytes_of(runs[0].lse)) << "run " << i;
    EXPECT_EQ(bytes_of(runs[i].dqkv), bytes_of(runs[0].dqkv)) << "run " << i;
  }
}

// Central differences of L = sum(out * R) through the whole group's forward
// against the assembled dqkv (dout = R), in f64 on a tiny shape, both splits.
TEST(CpAttention, GradientCheck) {
  for (bool ht : {true, false}) {
    const CpShape a{1, 8, 2, 1, 4, 2, ht};
    SCOPED_TRACE(a.str());
    auto qkv = randn(size_t(a.B * a.T * a.W()), 2601);
    const auto R = randn(size_t(a.B * a.T * a.C()), 2602);
    auto loss = [&] {
      const CpRun<double> r = run_cp(qkv, R, a);
      double L = 0;
      for (size_t i = 0; i < R.size(); ++i) L += r.out[i] * R[i];
      return L;
    };
    const CpRun<double> r = run_cp(qkv, R, a);
    EXPECT_LT(normwise_error(numeric_gradient(qkv, 1e-6, loss), r.dqkv), 1e-6);
  }
}

// The work of each rank: head-tail gives every rank the same causal pairs
// and, with chunks a multiple of the 32-row block, the same multiplied
// pairs (a rank's diagonal blocks are as many as its blocks); contiguous
// gives later ranks more. The ranks' causal pairs add up to the whole sequence's T (T + 1) / 2.
TEST(CpAttention, WorkPerRank) {
  for (int c : {2, 4})
    for (int64_t T : {int64_t(1024), int64_t(4096)}) {
      SCOPED_TRACE("c " + std::to_string(c) + " T " + std::to_string(T));
      const ContextSplit ht = ContextSplit::of(T, c), contiguous = ContextSplit::of(T, c, false);
      int64_t causal = 0, causal_contiguous = 0;
      for (int r = 0; r < c; ++r) {
        const CpAttentionWork w = cp_attention_work(ht, r), w0 = cp_attention_work(ht, 0);
        EXPECT_EQ(w.causal_pairs, w0.causal_pairs) << "rank " << r;
        EXPECT_EQ(w.computed_pairs, w0.computed_pairs) << "rank " << r;
        EXPECT_GE(w.computed_pairs, w.causal_pairs) << "rank " << r;
        EXPECT_LT(w.computed_pairs, w.causal_pairs + ht.local_rows() * 32) << "rank " << r;  // a block's diagonal
        causal += w.causal_pairs;
        const CpAttentionWork u = cp_attention_work(contiguous, r);
        if (r > 0) EXPECT_GT(u.causal_pairs, cp_attention_work(contiguous, r - 1).causal_pairs) << "rank " << r;
        causal_contiguous += u.causal_pairs;
      }
      EXPECT_EQ(causal, T * (T + 1) / 2);
      EXPECT_EQ(causal_contiguous, T * (T + 1) / 2);
    }
  expect_error([] { cp_attention_work(ContextSplit::of(10, 2), 0); }, ErrorKind::Shape,
               {"cp_attention_work", "not a multiple of 2 * cp"});
}

TEST(CpAttention, BadShapesAreShapeErrors) {
  KernelContext ctx;
  const int64_t B = 1, H = 2, KV = 1, D = 4, W = (H + 2 * KV) * D, T = 8, Tl = 4;
  const ContextSplit split = ContextSplit::of(T, 2);
  auto qkv = randn(size_t(B * Tl * W), 1), kv_all = randn(size_t(2 * B * Tl * 2 * KV * D), 2);
  auto out = randn(size_t(B * Tl * H * D), 3), lse = randn(size_t(B * H * Tl), 4);
  auto dq = qkv, dkv = kv_all, dout = out;
  auto fwd = [&](const ContextSplit& s, int rank, Shape kv_shape, Shape q_shape) {
    auto kv_copy = kv_all;
    kv_copy.resize(size_t(kv_shape.numel()));
    auto q_copy = qkv;
    q_copy.resize(size_t(q_shape.numel()));
    cp_attention_forward(ctx, view(out, {B, Tl, H * D}), view(lse, {B, H, Tl}), view(q_copy, q_shape),
                         view(kv_copy, kv_shape), s, rank, int(H), int(KV));
  };
  const Shape kvs{2, B, Tl, 2 * KV * D}, qs{B, Tl, W};
  fwd(split, 1, kvs, qs);  // the good call
  expect_error([&] { fwd(split, 1, {3, B, Tl, 2 * KV * D}, qs); }, ErrorKind::Shape, {"cp_attention_forward", "kv_all"});
  expect_error([&] { fwd(split, 2, kvs, qs); }, ErrorKind::Shape, {"rank 2"});
  expect_error([&] { fwd(ContextSplit::of(6, 2), 0, kvs, qs); }, ErrorKind::Shape, {"not a multiple of 2 * cp"});
  expect_error([&] { fwd(split, 0, kvs, {B, Tl + 1, W}); }, ErrorKind::Shape, {"rows per sequence"});
  expect_error([&] { fwd(split, 0, kvs, {B, Tl, W + 1}); }, ErrorKind::Shape, {"qkv must be"});
  expect_error(
      [&] {
        cp_attention_backward(ctx, view(dq, {B, Tl, W}), view(dkv, {2, B, Tl, 2 * KV * D}),
                              view(dout, {B, Tl, H * D}), view(qkv, {B, Tl, W}), view(kv_all, {2, B, Tl, 2 * KV * D}),
                              view(out, {B, Tl, H * D}), view(lse, {B, H, Tl}), split, 0, int(H), 2);
      },
      ErrorKind::Shape, {"cp_attention_backward", "n_kv_head"});
  auto small = randn(size_t(2 * B * Tl * (2 * KV * D - 1)), 5);
  expect_error(
      [&] {
        cp_attention_backward(ctx, view(dq, {B, Tl, W}), view(small, {2, B, Tl, 2 * KV * D - 1}),
                              view(dout, {B, Tl, H * D}), view(qkv, {B, Tl, W}), view(kv_all, {2, B, Tl, 2 * KV * D}),
                              view(out, {B, Tl, H * D}), view(lse, {B, H, Tl}), split, 0, int(H), int(KV));
      },
      ErrorKind::Shape, {"cp_attention_backward", "dkv_all"});
  auto kv = randn(size_t(B * Tl * 2 * KV * D) + 4, 6);
  expect_error([&] { kv_pack(ctx, view(kv, {B, Tl, 2 * KV * D + 1}), view(qkv, {B, Tl, W}), int(H), int(KV)); },
               ErrorKind::Shape, {"kv_pack", "kv"});
  expect_error([&] { kv_unpack(ctx, view(dq, {B, Tl, W}), view(kv, {B, Tl, 2 * KV * D + 1}), int(H), int(KV)); },
               ErrorKind::Shape, {"kv_unpack", "kv"});
}

// kv_pack copies exactly the k and v columns; kv_unpack writes exactly them.
TEST(CpAttention, PackAndUnpackMoveTheKeyValueColumns) {
  KernelContext ctx;
  const int64_t B = 2, T = 3, H = 4, KV = 2, D = 3, W = (H + 2 * KV) * D, K = 2 * KV * D;
  auto qkv = randn(size_t(B * T * W), 7), kv = randn(size_t(B * T * K), 8);
  kv_pack(ctx, view(kv, {B, T, K}), view(qkv, {B, T, W}), int(H), int(KV));
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t j = 0; j < K; ++j) ASSERT_EQ(kv[r * K + j], qkv[r * W + H * D + j]) << r << " " << j;
  auto dq = randn(size_t(B * T * W), 9);
  const auto before = dq;
  kv_unpack(ctx, view(dq, {B, T, W}), view(kv, {B, T, K}), int(H), int(KV));
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t j = 0; j < W; ++j)
      ASSERT_EQ(dq[r * W + j], j < H * D ? before[r * W + j] : kv[r * K + j - H * D]) << r << " " << j;
}

}  // namespace
}  // namespace xirang::test
