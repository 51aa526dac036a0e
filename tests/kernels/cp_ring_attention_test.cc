// Tests for kernels/cp_ring_attention.h: the ring's block steps, played for
// a whole cp group in one process, against flash attention over the whole
// sequence in float64 and against the all-gather path; the log-sum-exp
// merge against float64; the block masks (which keys a query sees, the
// work per step).
//
// The harness: each rank's local qkv is cut from the sequence's rows
// (tests/kernels/cp_rows.h) and packed (kv_pack); rank r runs steps s = 0 ..
// c-1 against rank (r - s) mod c's block, as the ring hands them over; the
// key/value gradients of each block are summed over the ranks that
// computed them (the ring's hops, here in double, rounded once) and unpacked
// into their owner's dqkv.
//
// Tolerances, relative to max(1, max |reference|): f32 against the f64
// reference 1e-5 (as flash_attention_test's f32 paths; the merge adds a
// rounding of out and lse per step); bf16 as cp_attention_test's
// 16-bit bounds (out 2u, dqkv (4 + c)u: each rank's dk, dv rounded once to
// bf16 before the sum). Against the all-gather path in f32: 1e-5, not bit
// for bit (the merge and the per-block sums round in another order).
#include <cmath>
#include <limits>

#include "kernels/attention.h"
#include "kernels/cp_attention.h"
#include "kernels/cp_ring_attention.h"
#include "tests/kernels/cp_rows.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

template <class S>
struct RingRun {
  std::vector<S> out, dqkv;
  std::vector<float> lse;
};

// The group through the ring; outputs in the sequence's layout.
template <class S>
RingRun<S> run_ring(const std::vector<S>& qkv, const std::vector<S>& dout, const CpShape& a) {
  KernelContext ctx;
  const ContextSplit split = a.split();
  const int64_t Tl = split.local_rows();
  const int c = a.c, H = int(a.H), KV = int(a.KV);
  RingRun<S> r{std::vector<S>(size_t(a.B * a.T * a.C())), std::vector<S>(qkv.size()),
           std::vector<float>(size_t(a.B * a.H * a.T))};
  std::vector<std::vector<S>> q(c), kv(c);
  for (int k = 0; k < c; ++k) {
    q[k] = local_rows(qkv, a, a.W(), k);
    kv[k] = cast_vec<S>(randn(size_t(a.B * Tl * a.KVW()), 3101 + k));
    kv_pack(ctx, view(kv[k], {a.B, Tl, a.KVW()}), view(q[k], {a.B, Tl, a.W()}), H, KV);
  }
  std::vector<std::vector<double>> dkv_sum(c, std::vector<double>(kv[0].size(), 0.0));
  for (int k = 0; k < c; ++k) {
    std::vector<float> oacc = cast_vec<float>(randn(size_t(a.B * Tl * a.C()), 3111 + k));  // begin clears them
    std::vector<float> lse = cast_vec<float>(randn(size_t(a.B * a.H * Tl), 3121 + k));
    std::vector<float> dq = cast_vec<float>(randn(oacc.size(), 3131 + k));
    std::vector<S> o = cast_vec<S>(randn(oacc.size(), 3141 + k)), d = local_rows(dout, a, a.C(), k);
    Tensor qt = view(q[k], {a.B, Tl, a.W()}), ot = view(o, {a.B, Tl, a.C()}), lt = view(lse, {a.B, a.H, Tl});
    Tensor acc = view(oacc, {a.B, Tl, a.C()}), dqt = view(dq, {a.B, Tl, a.C()});
    cp_ring_forward_begin(ctx, acc, lt);
    for (int s = 0; s < c; ++s) {
      const int src = (k - s + c) % c;
      cp_ring_forward_step(ctx, acc, lt, qt, view(kv[src], {a.B, Tl, a.KVW()}), split, k, src, H, KV);
    }
    cp_ring_forward_end(ctx, ot, acc);
    cp_ring_backward_begin(ctx, dqt);
    for (int s = 0; s < c; ++s) {
      const int src = (k - s + c) % c;
      std::vector<S> dkv = cast_vec<S>(randn(kv[src].size(), 3151 + s));  // overwritten
      cp_ring_backward_step(ctx, dqt, view(dkv, {a.B, Tl, a.KVW()}), view(d, {a.B, Tl, a.C()}), qt,
                            view(kv[src], {a.B, Tl, a.KVW()}), ot, lt, split, k, src, H, KV);
      for (size_t i = 0; i < dkv.size(); ++i) dkv_sum[size_t(src)][i] += as_double(dkv[i]);
    }
    std::vector<S> dqkv = cast_vec<S>(randn(q[k].size(), 3161 + k));
    cp_ring_backward_end(ctx, view(dqkv, {a.B, Tl, a.W()}), dqt, H, KV);
    q[k] = dqkv;  // q's values are spent: the rank's dqkv from here on
    put_rows(r.out, o, a, a.C(), k);
    for (int64_t bh = 0; bh < a.B * a.H; ++bh)
      for (int64_t t = 0; t < Tl; ++t) r.lse[size_t(bh * a.T + split.position(k, t))] = lse[size_t(bh * Tl + t)];
  }
  for (int k = 0; k < c; ++k) {
    std::vector<S> mine = cast_vec<S>(dkv_sum[size_t(k)]);
    kv_unpack(ctx, view(q[k], {a.B, Tl, a.W()}), view(mine, {a.B, Tl, a.KVW()}), H, KV);
    put_rows(r.dqkv, q[k], a, a.W(), k);
  }
  return r;
}

// Flash attention over the whole sequence (f64: the reference).
template <class S>
RingRun<S> run_flash(std::vector<S> qkv, std::vector<S> dout, const CpShape& a) {
  KernelContext ctx;
  RingRun<S> r{std::vector<S>(size_t(a.B * a.T * a.C())), std::vector<S>(qkv.size()), {}};
  std::vector<StatType<S>> lse(size_t(a.B * a.H * a.T));
  Tensor q = view(qkv, {a.B, a.T, a.W()}), o = view(r.out, {a.B, a.T, a.C()}), l = view(lse, {a.B, a.H, a.T});
  flash_attention_forward(ctx, o, l, q, int(a.H), int(a.KV));
  flash_attention_backward(ctx, view(r.dqkv, {a.B, a.T, a.W()}), view(dout, {a.B, a.T, a.C()}), q, o, l, int(a.H),
                           int(a.KV));
  for (auto x : lse) r.lse.push_back(float(x));
  return r;
}

// B = 2, H = 4, KV in {4, 2, 1}, chunks of 5 .. 40 tokens (a chunk over the
// 32-row query block too), head-tail and contiguous, c = 2 and 4.
std::vector<CpShape> ring_shapes() {
  std::vector<CpShape> v;
  int i = 0;
  for (int c : {2, 4})
    for (bool ht : {true, false})
      for (int64_t kv : {4, 2, 1}) {
        const int64_t L = i == 3 ? 40 : 5 + (7 * i) % 12, D = i % 2 ? 8 : 16;
        ++i;
        v.push_back({2, 2 * c * L, 4, kv, D, c, ht});
      }
  return v;
}

TEST(CpRingAttention, F32RingEqualsFloat64AndAllGather) {
  for (const CpShape& a : ring_shapes()) {
    SCOPED_TRACE(a.str());
    const Vec qkv = randn(size_t(a.B * a.T * a.W()), 3201 + a.T), dout = randn(size_t(a.B * a.T * a.C()), 3202 + a.T);
    const RingRun<float> got = run_ring(cast_vec<float>(qkv), cast_vec<float>(dout), a);
    const RingRun<double> want = run_flash(qkv, dout, a);
    expect_near(got.out, want.out, 1e-5, "out");
    expect_near(got.lse, to_f64(want.lse), 1e-5, "lse");
    expect_near(got.dqkv, want.dqkv, 1e-5, "dqkv");
    // The all-gather path on the same f32 inputs (its own test ties it to flash).
    const RingRun<float> flat = run_flash(cast_vec<float>(qkv), cast_vec<float>(dout), a);
    expect_near(got.out, to_f64(flat.out), 1e-5, "out vs f32");
    expect_near(got.dqkv, to_f64(flat.dqkv), 1e-5, "dqkv vs f32");
  }
}

TEST(CpRingAttention, Bf16AgainstFloat64) {
  const double u = unit_roundoff<bf16>();
  for (const CpShape& a : ring_shapes()) {
    SCOPED_TRACE(a.str());
    const auto qkv = cast_vec<bf16>(randn(size_t(a.B * a.T * a.W()), 3301 + a.T));
    const auto dout = cast_vec<bf16>(randn(size_t(a.B * a.T * a.C()), 3302 + a.T));
    const RingRun<bf16> got = run_ring(qkv, dout, a);
    const RingRun<double> want = run_flash(to_f64(qkv), to_f64(dout), a);
    expect_near(got.out, want.out, 2 * u, "out");
    expect_near(got.lse, to_f64(want.lse), 1e-5, "lse");
    expect_near(got.dqkv, want.dqkv, (4 + a.c) * u, "dqkv");
  }
}

// The merge of two partial softmaxes of one row against the softmax of
// their union, all in double from the same scores: random rows, both
// orders of size between the sides, and a side that has seen no key.
TEST(CpRingAttention, LseMergeAgainstFloat64) {
  KernelContext ctx;
  const int64_t B = 2, T = 5, H = 3, D = 8, C = H * D, nA = 7, nB = 11;
  const Vec sa = randn(size_t(B * H * T * nA), 3401, 3.0), sb = randn(size_t(B * H * T * nB), 3402, 3.0, 2.0);
  const Vec va = randn(size_t(B * H * T * nA * D), 3403), vb = randn(size_t(B * H * T * nB * D), 3404);
  std::vector<float> oa(size_t(B * T * C)), ob(oa.size()), la(size_t(B * H * T)), lb(la.size());
  Vec want_o(oa.size()), want_l(la.size());
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = (b * H + h) * T + t, orow = (b * T + t) * C + h * D;
        // A side's softmax in double: its lse, and its normalized output rounded to float.
        auto side = [&](const Vec& s, const Vec& v, int64_t n, std::vector<float>& o, std::vector<float>& l) {
          double mx = -INFINITY, sum = 0;
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[size_t(row * n + j)]);
          for (int64_t j = 0; j < n; ++j) sum += std::exp(s[size_t(row * n + j)] - mx);
          l[size_t(row)] = float(mx + std::log(sum));
          for (int64_t c = 0; c < D; ++c) {
            double acc = 0;
            for (int64_t j = 0; j < n; ++j)
              acc += std::exp(s[size_t(row * n + j)] - mx) / sum * v[size_t((row * n + j) * D + c)];
            o[size_t(orow + c)] = float(acc);
          }
        };
        side(sa, va, nA, oa, la);
        side(sb, vb, nB, ob, lb);
        const bool a_empty = t == 1, b_empty = t == 3;  // rows where one side saw no key
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < nA && !a_empty; ++j) mx = std::max(mx, sa[size_t(row * nA + j)]);
        for (int64_t j = 0; j < nB && !b_empty; ++j) mx = std::max(mx, sb[size_t(row * nB + j)]);
        for (int64_t j = 0; j < nA && !a_empty; ++j) sum += std::exp(sa[size_t(row * nA + j)] - mx);
        for (int64_t j = 0; j < nB && !b_empty; ++j) sum += std::exp(sb[size_t(row * nB + j)] - mx);
        want_l[size_t(row)] = mx + std::log(sum);
        for (int64_t c = 0; c < D; ++c) {
          double acc = 0;
          for (int64_t j = 0; j < nA && !a_empty; ++j)
            acc += std::exp(sa[size_t(row * nA + j)] - mx) / sum * va[size_t((row * nA + j) * D + c)];
          for (int64_t j = 0; j < nB && !b_empty; ++j)
            acc += std::exp(sb[size_t(row * nB + j)] - mx) / sum * vb[size_t((row * nB + j) * D + c)];
          want_o[size_t(orow + c)] = acc;
        }
        if (a_empty) {
          la[size_t(row)] = ninf;
          for (int64_t c = 0; c < D; ++c) oa[size_t(orow + c)] = 1e30f;  // never read
        }
        if (b_empty) lb[size_t(row)] = ninf;
      }
  attention_lse_merge(ctx, view(oa, {B, T, C}), view(la, {B, H, T}), view(ob, {B, T, C}), view(lb, {B, H, T}),
                      int(H));
  // Each side is rounded to float once, the merge once more: a few float ulps.
  expect_near(oa, want_o, 1e-6, "merged out");
  expect_near(la, want_l, 1e-6, "merged lse");
}

// cp_ring_keys_seen against counting src's positions <= p, and the work of
// each (rank, src) step under head-tail: two chunks' worth of pairs, as the
// header's table says (L^2 + L^2 apart; the own step L(L+1)/2 x 2 + L^2).
TEST(CpRingAttention, BlockMasksAndBalancedSteps) {
  for (const bool ht : {true, false})
    for (const int c : {1, 2, 4}) {
      const int64_t L = 6, T = 2 * c * L;
      const ContextSplit s = ContextSplit::of(T, c, ht);
      for (int src = 0; src < c; ++src)
        for (int64_t p = 0; p < T; ++p) {
          int64_t n = 0;
          for (int64_t t = 0; t < s.local_rows(); ++t) n += s.position(src, t) <= p;
          ASSERT_EQ(cp_ring_keys_seen(s, src, p), n) << "c " << c << " src " << src << " p " << p;
        }
      if (!ht || c == 1) continue;
      for (int r = 0; r < c; ++r)
        for (int src = 0; src < c; ++src) {
          int64_t pairs = 0;
          for (int64_t t = 0; t < s.local_rows(); ++t) pairs += cp_ring_keys_seen(s, src, s.position(r, t));
          EXPECT_EQ(pairs, src == r ? L * (L + 1) + L * L : 2 * L * L) << "c " << c << " rank " << r << " src " << src;
        }
    }
}

TEST(CpRingAttention, RejectsF64AndMismatchedBlocks) {
  KernelContext ctx;
  const ContextSplit s = ContextSplit::of(8, 2);
  std::vector<double> q(size_t(4 * 3 * 8)), kv(size_t(4 * 2 * 8)), o(size_t(4 * 8)), l(4);
  std::vector<float> of(o.size()), lf(l.size());
  expect_error([&] {
    cp_ring_forward_step(ctx, view(of, {1, 4, 8}), view(lf, {1, 1, 4}), view(q, {1, 4, 24}), view(kv, {1, 4, 16}), s, 0,
                         1, 1);
  }, ErrorKind::Shape, {"cp_ring_forward_step", "f64 is not supported"});
  std::vector<float> qf(q.size()), kvf(size_t(4 * 16 * 2));
  expect_error([&] {
    cp_ring_forward_step(ctx, view(of, {1, 4, 8}), view(lf, {1, 1, 4}), view(qf, {1, 4, 24}), view(kvf, {1, 8, 16}),
                         s, 0, 1, 1);
  }, ErrorKind::Shape, {"cp_ring_forward_step", "kv"});
}

}  // namespace
}  // namespace xirang::test
