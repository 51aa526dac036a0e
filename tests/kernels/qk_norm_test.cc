// Tests for kernels/qk_norm.h (Qwen3's per-head q/k RMSNorm) against a
// float64 transcription of transformers' Qwen3RMSNorm applied to the q and
// k heads, in every storage dtype; a finite-difference check of the float64
// backward for d(qkv), dq_w and dk_w; and the per-head result against
// rmsnorm_forward bit for bit.
//
// Tolerances, as max |got - ref| <= tol * max(1, max |ref|), rmsnorm's
// (tests/kernels/rmsnorm_test.cc) for a row of D:
// - F32: 1e-5. The sum of squares is in double; y = (x rstd) w carries two
//   float roundings (~1e-7 relative); dx sums D = 24 products in double and
//   rounds once; dq_w sums 14 tokens x 4 heads in double. A 10x margin over
//   a correct kernel; a wrong eps, weight or formula is off by 1e-3 or more.
// - F64: 1e-10 (only the summation order differs from the reference).
// - BF16/F16: 2u (u = 2^-8, 2^-11), each output formed in float or double
//   from the rounded inputs and rounded once; and >= 97% of the elements
//   must equal the reference rounded once. rstd is F32 (1e-5); F32 weight
//   gradients beside 16-bit activations keep the F32 tolerance.
#include <omp.h>

#include <cmath>

#include "kernels/qk_norm.h"
#include "kernels/rmsnorm.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;
constexpr double kMinRounded = 0.97;
constexpr double kNormEps = 1e-6;  // Qwen3's rms_norm_eps

struct QkDims {
  int64_t N, H, KV, D;  // tokens, query heads, key/value heads, head_dim
  int64_t width() const { return (H + 2 * KV) * D; }
  int64_t normed() const { return H + KV; }
};

struct QkNormOut {
  Vec out, rstd;  // (N, (H + 2 KV) D), (N, H + KV)
};

// Qwen3RMSNorm.forward on each head of q = qkv[.., :H D].view(.., H, D) and
// k = qkv[.., H D:(H + KV) D].view(.., KV, D):
//   variance = x.pow(2).mean(-1); x = x * rsqrt(variance + eps); weight * x
// and v = qkv[.., (H + KV) D:] as it is.
QkNormOut ref_qk_forward(const Vec& qkv, const Vec& q_w, const Vec& k_w, const QkDims& d, double eps) {
  QkNormOut r{qkv, Vec(d.N * d.normed())};
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t h = 0; h < d.normed(); ++h) {
      const double* x = qkv.data() + n * d.width() + h * d.D;
      const Vec& w = h < d.H ? q_w : k_w;
      double variance = 0;
      for (int64_t j = 0; j < d.D; ++j) variance += x[j] * x[j];
      variance /= double(d.D);
      const double rs = 1.0 / std::sqrt(variance + eps);
      r.rstd[n * d.normed() + h] = rs;
      for (int64_t j = 0; j < d.D; ++j) r.out[n * d.width() + h * d.D + j] = w[j] * (x[j] * rs);
    }
  return r;
}

struct QkNormGrads {
  Vec dqkv, dq_w, dk_w;  // the gradients alone
};

// Per q or k head, with r = (m + eps)^(-1/2), m = sum_j x_j^2 / D:
// dL/dx_k = r dy_k w_k - (r^3 x_k / D) sum_j dy_j w_j x_j, dL/dw_k = sum dy_k x_k r
// over the heads that use w; a v head's gradient is dy.
QkNormGrads ref_qk_backward(const Vec& dy, const Vec& qkv, const Vec& q_w, const Vec& k_w, const QkDims& d,
                            double eps) {
  QkNormGrads g{dy, Vec(d.D, 0.0), Vec(d.D, 0.0)};
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t h = 0; h < d.normed(); ++h) {
      const int64_t off = n * d.width() + h * d.D;
      const Vec& w = h < d.H ? q_w : k_w;
      Vec& dw = h < d.H ? g.dq_w : g.dk_w;
      double ms = 0, dot = 0;
      for (int64_t j = 0; j < d.D; ++j) {
        ms += qkv[off + j] * qkv[off + j];
        dot += dy[off + j] * w[j] * qkv[off + j];
      }
      const double r = 1.0 / std::sqrt(ms / double(d.D) + eps);
      for (int64_t j = 0; j < d.D; ++j) {
        g.dqkv[off + j] = r * dy[off + j] * w[j] - r * r * r * qkv[off + j] * dot / double(d.D);
        dw[j] += dy[off + j] * qkv[off + j] * r;
      }
    }
  return g;
}

template <class S>
using stat_t = std::conditional_t<is_16bit_v<S>, float, S>;

template <class S>
double tolerance() {
  if constexpr (is_16bit_v<S>) return 2 * unit_roundoff<S>();
  else return tol<S>(kTolF32);
}

template <class S>
class QkNormTest : public ::testing::Test {
 protected:
  // 2 sequences of 7 tokens, H 4 and KV 2 heads of D 24: q_w and k_w
  // differ (around 1 and around 0.5), so a swapped weight shows.
  static constexpr int64_t B = 2, T = 7, H = 4, KV = 2, D = 24;
  static constexpr QkDims d{B * T, H, KV, D};
  static constexpr int64_t W = (H + 2 * KV) * D;
  KernelContext ctx;
  // Heads with a non-zero mean and scale 2: every term matters.
  std::vector<S> qkv = cast_vec<S>(randn(B * T * W, 2601, 2.0, 0.5));
  std::vector<S> q_w = cast_vec<S>(randn(D, 2602, 0.5, 1.0));
  std::vector<S> k_w = cast_vec<S>(randn(D, 2603, 0.3, 0.5));
  std::vector<S> dy = cast_vec<S>(randn(B * T * W, 2604));

  Tensor qkv_view(std::vector<S>& v) { return view(v, {B, T, W}); }
  template <class R>
  Tensor rstd_view(std::vector<R>& v) {
    return view(v, {B, T, H + KV});
  }

  // The kernel forward on fresh random outputs.
  void forward(std::vector<S>& out, std::vector<stat_t<S>>& rstd, double eps = kNormEps) {
    out = cast_vec<S>(randn(B * T * W, 2605));
    rstd = cast_vec<stat_t<S>>(randn(B * T * (H + KV), 2606));
    qk_rmsnorm_forward(ctx, qkv_view(out), rstd_view(rstd), qkv_view(qkv), view(q_w, {D}), view(k_w, {D}), H, KV,
                       eps);
  }
};
using AllStorage = ::testing::Types<float, double, bf16, f16>;
TYPED_TEST_SUITE(QkNormTest, AllStorage);

// Out of place against the reference, v copied bit for bit; then in place,
// bitwise the same as out of place.
TYPED_TEST(QkNormTest, Forward) {
  using S = TypeParam;
  auto& f = *this;
  std::vector<S> out;
  std::vector<stat_t<S>> rstd;
  f.forward(out, rstd);
  QkNormOut r = ref_qk_forward(to_f64(f.qkv), to_f64(f.q_w), to_f64(f.k_w), f.d, kNormEps);
  expect_near(out, r.out, tolerance<S>(), "out");
  expect_near(rstd, r.rstd, tol<stat_t<S>>(kTolF32), "rstd");
  if constexpr (is_16bit_v<S>) expect_mostly_rounded(out, r.out, kMinRounded, "out");
  for (int64_t n = 0; n < f.d.N; ++n)
    for (int64_t j = f.d.normed() * f.D; j < f.W; ++j)
      ASSERT_EQ(as_double(out[n * f.W + j]), as_double(f.qkv[n * f.W + j])) << "v at token " << n << ", " << j;

  std::vector<S> in_place = f.qkv;
  auto rstd2 = cast_vec<stat_t<S>>(randn(f.d.N * f.d.normed(), 2607));
  qk_rmsnorm_forward(f.ctx, f.qkv_view(in_place), f.rstd_view(rstd2), f.qkv_view(in_place), view(f.q_w, {f.D}),
                     view(f.k_w, {f.D}), f.H, f.KV, kNormEps);
  EXPECT_EQ(bytes_of(in_place), bytes_of(out)) << "in place";
  EXPECT_EQ(bytes_of(rstd2), bytes_of(rstd)) << "in-place rstd";
}

// Heads of scale 3e-3 (mean square ~1e-5): eps is then a tenth to a half of
// the denominator, so eps outside the square root, added to the sum rather
// than the mean, or not the eps passed (1e-6 and 1e-5 both run) moves the
// output by 5% or more. rstd ~ 300: compared relative to its own size.
TYPED_TEST(QkNormTest, SmallHeadsUseEps) {
  using S = TypeParam;
  auto& f = *this;
  f.qkv = cast_vec<S>(randn(f.qkv.size(), 2611, 3e-3));
  for (double eps : {1e-5, 1e-6}) {
    SCOPED_TRACE(eps);
    std::vector<S> out;
    std::vector<stat_t<S>> rstd;
    f.forward(out, rstd, eps);
    QkNormOut r = ref_qk_forward(to_f64(f.qkv), to_f64(f.q_w), to_f64(f.k_w), f.d, eps);
    // Outputs are of order 1 except v (3e-3): compared against the scale 1 as in expect_near.
    expect_near(out, r.out, tolerance<S>(), "out");
    Vec got = to_f64(rstd), want = r.rstd;
    for (size_t i = 0; i < got.size(); ++i) got[i] /= want[i], want[i] = 1.0;
    expect_near(got, want, tol<stat_t<S>>(kTolF32), "rstd / reference rstd");
  }
}

// dqkv in both modes on random prior contents (v's gradient passes through
// or is added); dq_w, dk_w always accumulate, in S and (16-bit) in F32 over
// two microbatches. Then Overwrite with dqkv = dout, in place.
TYPED_TEST(QkNormTest, Backward) {
  using S = TypeParam;
  using St = stat_t<S>;
  auto& f = *this;
  const int64_t D = f.D;
  std::vector<S> out;
  std::vector<St> rstd;
  f.forward(out, rstd);
  QkNormGrads g = ref_qk_backward(to_f64(f.dy), to_f64(f.qkv), to_f64(f.q_w), to_f64(f.k_w), f.d, kNormEps);
  auto run = [&](std::vector<S>& dx, auto& dq_w, auto& dk_w, std::vector<S>& dout, GradMode mode) {
    qk_rmsnorm_backward(f.ctx, f.qkv_view(dx), view(dq_w, {D}), view(dk_w, {D}), f.qkv_view(dout), f.qkv_view(f.qkv),
                        view(f.q_w, {D}), view(f.k_w, {D}), f.rstd_view(rstd), f.H, f.KV, mode);
  };
  for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate}) {
    SCOPED_TRACE(mode == GradMode::Overwrite ? "Overwrite" : "Accumulate");
    auto dx = cast_vec<S>(randn(f.dy.size(), 2621));
    auto dq_w = cast_vec<S>(randn(D, 2622)), dk_w = cast_vec<S>(randn(D, 2623));
    Vec dx0 = to_f64(dx), dq0 = to_f64(dq_w), dk0 = to_f64(dk_w);
    run(dx, dq_w, dk_w, f.dy, mode);
    Vec want_dx = mode == GradMode::Overwrite ? g.dqkv : plus(dx0, g.dqkv);
    expect_near(dx, want_dx, tolerance<S>(), "dqkv");
    expect_near(dq_w, plus(dq0, g.dq_w), tolerance<S>(), "dq_w");
    expect_near(dk_w, plus(dk0, g.dk_w), tolerance<S>(), "dk_w");
    if constexpr (is_16bit_v<S>) expect_mostly_rounded(dx, want_dx, kMinRounded, "dqkv");
  }
  {
    auto dx = cast_vec<S>(randn(f.dy.size(), 2624));
    auto dq_w = cast_vec<S>(randn(D, 2625)), dk_w = cast_vec<S>(randn(D, 2626));
    auto dq_in = dq_w, dk_in = dk_w;
    run(dx, dq_w, dk_w, f.dy, GradMode::Overwrite);
    std::vector<S> in_place = f.dy;
    run(in_place, dq_in, dk_in, in_place, GradMode::Overwrite);
    EXPECT_EQ(bytes_of(in_place), bytes_of(dx)) << "dqkv in place";
    EXPECT_EQ(bytes_of(dq_in), bytes_of(dq_w)) << "dq_w in place";
    EXPECT_EQ(bytes_of(dk_in), bytes_of(dk_w)) << "dk_w in place";
  }
  if constexpr (is_16bit_v<S>) {
    auto dx = cast_vec<S>(randn(f.dy.size(), 2627));
    auto dq_w = cast_vec<float>(randn(D, 2628)), dk_w = cast_vec<float>(randn(D, 2629));
    Vec want_q = to_f64(dq_w), want_k = to_f64(dk_w);
    for (int micro = 0; micro < 2; ++micro) {
      run(dx, dq_w, dk_w, f.dy, GradMode::Overwrite);
      want_q = plus(want_q, g.dq_w);
      want_k = plus(want_k, g.dk_w);
    }
    expect_near(dq_w, want_q, kTolF32, "f32 dq_w");
    expect_near(dk_w, want_k, kTolF32, "f32 dk_w");
  }
}

// Each q head equals rmsnorm_forward of that head with q_w, each k head
// with k_w, bit for bit (the same arithmetic, so a Qwen3 block and a
// row-wise norm of the gathered heads cannot drift apart); the same for
// the backward's dqkv against rmsnorm_backward's dx.
TYPED_TEST(QkNormTest, MatchesRmsNormPerHeadBitwise) {
  using S = TypeParam;
  using St = stat_t<S>;
  auto& f = *this;
  const int64_t N = f.d.N, D = f.D, H = f.H, KV = f.KV, W = f.W;
  std::vector<S> out;
  std::vector<St> rstd;
  f.forward(out, rstd);
  auto dx = cast_vec<S>(randn(f.dy.size(), 2631));
  auto dq_w = cast_vec<S>(randn(D, 2632)), dk_w = cast_vec<S>(randn(D, 2633));
  qk_rmsnorm_backward(f.ctx, f.qkv_view(dx), view(dq_w, {D}), view(dk_w, {D}), f.qkv_view(f.dy), f.qkv_view(f.qkv),
                      view(f.q_w, {D}), view(f.k_w, {D}), f.rstd_view(rstd), H, KV, GradMode::Overwrite);
  for (int part = 0; part < 2; ++part) {
    SCOPED_TRACE(part == 0 ? "q heads" : "k heads");
    const int64_t h0 = part == 0 ? 0 : H, nh = part == 0 ? H : KV;
    std::vector<S> x(N * nh * D), dyr(N * nh * D), y(N * nh * D), dxr(N * nh * D), got_y(N * nh * D),
        got_dx(N * nh * D), dw(D);
    std::vector<St> r(N * nh), got_r(N * nh);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < nh; ++h) {
        got_r[n * nh + h] = rstd[n * (H + KV) + h0 + h];
        for (int64_t j = 0; j < D; ++j) {
          const int64_t src = n * W + (h0 + h) * D + j, dst = (n * nh + h) * D + j;
          x[dst] = f.qkv[src], dyr[dst] = f.dy[src], got_y[dst] = out[src], got_dx[dst] = dx[src];
        }
      }
    std::vector<S>& w = part == 0 ? f.q_w : f.k_w;
    rmsnorm_forward(f.ctx, view(y, {N * nh, D}), view(r, {N * nh}), view(x, {N * nh, D}), view(w, {D}), kNormEps);
    rmsnorm_backward(f.ctx, view(dxr, {N * nh, D}), view(dw, {D}), view(dyr, {N * nh, D}), view(x, {N * nh, D}),
                     view(w, {D}), view(r, {N * nh}), GradMode::Overwrite);
    EXPECT_EQ(bytes_of(got_y), bytes_of(y)) << "out";
    EXPECT_EQ(bytes_of(got_r), bytes_of(r)) << "rstd";
    EXPECT_EQ(bytes_of(got_dx), bytes_of(dxr)) << "dqkv";
  }
}

// A tensor-parallel rank of tp = 2 holds H / 2 query and KV / 2 key/value
// heads of every token in the same layout: its outputs are the full op's
// for those heads bit for bit, and the ranks' dq_w, dk_w sum to the full
// op's (F64: only the summation order differs).
TEST(QkNormTensorParallel, RankSliceMatchesFullOp) {
  const QkDims full{9, 4, 2, 16};
  const QkDims local{9, 2, 1, 16};
  const int64_t D = full.D;
  KernelContext ctx;
  Vec qkv = randn(full.N * full.width(), 2641, 1.5, 0.3), dy = randn(qkv.size(), 2642);
  Vec q_w = randn(D, 2643, 0.5, 1.0), k_w = randn(D, 2644, 0.3, 0.5);
  Vec out(qkv.size()), rstd(full.N * full.normed()), dx(qkv.size()), dq_w(D, 0.0), dk_w(D, 0.0);
  qk_rmsnorm_forward(ctx, view(out, {full.N, full.width()}), view(rstd, {full.N, full.normed()}),
                     view(qkv, {full.N, full.width()}), view(q_w, {D}), view(k_w, {D}), 4, 2, kNormEps);
  qk_rmsnorm_backward(ctx, view(dx, {full.N, full.width()}), view(dq_w, {D}), view(dk_w, {D}),
                      view(dy, {full.N, full.width()}), view(qkv, {full.N, full.width()}), view(q_w, {D}),
                      view(k_w, {D}), view(rstd, {full.N, full.normed()}), 4, 2, GradMode::Overwrite);
  // Full head index of local head h on rank t: q heads t H/2 + h, k heads
  // H + t KV/2 + (h - H/2), v heads H + KV + t KV/2 + (h - H/2 - KV/2).
  auto full_head = [&](int64_t t, int64_t h) {
    if (h < local.H) return t * local.H + h;
    if (h < local.normed()) return full.H + t * local.KV + (h - local.H);
    return full.normed() + t * local.KV + (h - local.normed());
  };
  Vec dq_sum(D, 0.0), dk_sum(D, 0.0);
  for (int64_t t = 0; t < 2; ++t) {
    SCOPED_TRACE("rank " + std::to_string(t));
    const int64_t lw = local.width();
    Vec lx(full.N * lw), ldy(full.N * lw), lout(full.N * lw), lr(full.N * local.normed()), ldx(full.N * lw);
    for (int64_t n = 0; n < full.N; ++n)
      for (int64_t h = 0; h < local.H + 2 * local.KV; ++h)
        for (int64_t j = 0; j < D; ++j) {
          lx[n * lw + h * D + j] = qkv[n * full.width() + full_head(t, h) * D + j];
          ldy[n * lw + h * D + j] = dy[n * full.width() + full_head(t, h) * D + j];
        }
    qk_rmsnorm_forward(ctx, view(lout, {full.N, lw}), view(lr, {full.N, local.normed()}), view(lx, {full.N, lw}),
                       view(q_w, {D}), view(k_w, {D}), 2, 1, kNormEps);
    qk_rmsnorm_backward(ctx, view(ldx, {full.N, lw}), view(dq_sum, {D}), view(dk_sum, {D}), view(ldy, {full.N, lw}),
                        view(lx, {full.N, lw}), view(q_w, {D}), view(k_w, {D}), view(lr, {full.N, local.normed()}), 2,
                        1, GradMode::Overwrite);
    for (int64_t n = 0; n < full.N; ++n)
      for (int64_t h = 0; h < local.H + 2 * local.KV; ++h) {
        if (h < local.normed()) {
          ASSERT_EQ(lr[n * local.normed() + h], rstd[n * full.normed() + full_head(t, h)]) << n << " " << h;
        }
        for (int64_t j = 0; j < D; ++j) {
          ASSERT_EQ(lout[n * lw + h * D + j], out[n * full.width() + full_head(t, h) * D + j]) << n << " " << h;
          ASSERT_EQ(ldx[n * lw + h * D + j], dx[n * full.width() + full_head(t, h) * D + j]) << n << " " << h;
        }
      }
  }
  expect_near(dq_sum, dq_w, 1e-12, "dq_w summed over ranks");
  expect_near(dk_sum, dk_w, 1e-12, "dk_w summed over ranks");
}

// dq_w, dk_w sum tokens in fixed chunks added in order, so the results are
// bitwise the same whatever the thread count. In F64, where a different
// summation order would show in the last bits.
TEST(QkNormDeterminism, IndependentOfThreadCount) {
  const QkDims d{67, 4, 2, 16};
  KernelContext ctx;
  Vec qkv = randn(d.N * d.width(), 2651, 1.5), dy = randn(qkv.size(), 2652);
  Vec q_w = randn(d.D, 2653, 0.5, 1.0), k_w = randn(d.D, 2654, 0.3, 0.5);
  Vec out(qkv.size()), rstd(d.N * d.normed());
  qk_rmsnorm_forward(ctx, view(out, {d.N, d.width()}), view(rstd, {d.N, d.normed()}), view(qkv, {d.N, d.width()}),
                     view(q_w, {d.D}), view(k_w, {d.D}), 4, 2, kNormEps);
  const int saved = omp_get_max_threads();
  std::vector<std::vector<uint8_t>> runs;
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    Vec dx(qkv.size()), dq_w = randn(d.D, 2655), dk_w = randn(d.D, 2656);
    qk_rmsnorm_backward(ctx, view(dx, {d.N, d.width()}), view(dq_w, {d.D}), view(dk_w, {d.D}),
                        view(dy, {d.N, d.width()}), view(qkv, {d.N, d.width()}), view(q_w, {d.D}), view(k_w, {d.D}),
                        view(rstd, {d.N, d.normed()}), 4, 2, GradMode::Overwrite);
    std::vector<uint8_t> b = bytes_of(dx), bq = bytes_of(dq_w), bk = bytes_of(dk_w);
    b.insert(b.end(), bq.begin(), bq.end());
    b.insert(b.end(), bk.begin(), bk.end());
    runs.push_back(b);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(runs[0], runs[1]);
}

// Central differences on L = sum(out * R), float64, against the kernel's
// own F64 backward (dout = R); h = 1e-6 (tests/kernels/gradcheck.h). Heads
// of scale 0.05 make eps (1e-3 here) a third of the mean square, so its
// gradient path counts. R also weighs the v heads, whose gradient is R.
TEST(QkNormGradCheck, FiniteDifferences) {
  const QkDims d{3, 2, 1, 8};
  const double h = 1e-6, eps = 1e-3;
  KernelContext ctx;
  for (double scale : {1.5, 0.05}) {
    SCOPED_TRACE(scale);
    Vec qkv = randn(d.N * d.width(), 2661, scale, 0.1 * scale), R = randn(qkv.size(), 2662);
    Vec q_w = randn(d.D, 2663, 0.5, 1.0), k_w = randn(d.D, 2664, 0.3, 0.5);
    Vec out(qkv.size()), rstd(d.N * d.normed());
    auto loss = [&]() {
      qk_rmsnorm_forward(ctx, view(out, {d.N, d.width()}), view(rstd, {d.N, d.normed()}), view(qkv, {d.N, d.width()}),
                         view(q_w, {d.D}), view(k_w, {d.D}), 2, 1, eps);
      double L = 0;
      for (size_t i = 0; i < out.size(); ++i) L += out[i] * R[i];
      return L;
    };
    loss();
    Vec dx(qkv.size()), dq_w(d.D, 0.0), dk_w(d.D, 0.0);
    qk_rmsnorm_backward(ctx, view(dx, {d.N, d.width()}), view(dq_w, {d.D}), view(dk_w, {d.D}),
                        view(R, {d.N, d.width()}), view(qkv, {d.N, d.width()}), view(q_w, {d.D}), view(k_w, {d.D}),
                        view(rstd, {d.N, d.normed()}), 2, 1, GradMode::Overwrite);
    EXPECT_LT(normwise_error(numeric_gradient(qkv, h, loss), dx), 1e-6) << "dqkv";
    EXPECT_LT(normwise_error(numeric_gradient(q_w, h, loss), dq_w), 1e-6) << "dq_w";
    EXPECT_LT(normwise_error(numeric_gradient(k_w, h, loss), dk_w), 1e-6) << "dk_w";
  }
}

TEST(QkNormErrors, ShapesDtypesAndAliases) {
  KernelContext ctx;
  const int64_t N = 3, D = 8, W = (2 + 2) * D;  // H 2, KV 1
  std::vector<float> qkv(N * W, 1.0f), out(N * W), dq(D), dk(D), w(D, 1.0f), w_big(D + 1), r(N * 3),
      r_small(N * 2);
  std::vector<bf16> qkv16(N * W), w16(D), r16(N * 3);
  std::vector<f16> dw_f16(D);
  std::vector<float> r32(N * 3);
  auto fwd = [&](std::vector<float>& rs, int64_t nr, std::vector<float>& kw, int64_t nk, int H, int KV) {
    qk_rmsnorm_forward(ctx, view(out, {N, W}), view(rs, {nr}), view(qkv, {N, W}), view(w, {D}), view(kw, {nk}), H, KV,
                       1e-6);
  };
  expect_error([&] { fwd(r, N * 3, w, D, 3, 1); }, ErrorKind::Shape, {"qk_rmsnorm_forward", "n_head 3"});
  expect_error([&] { fwd(r, N * 3, w, D, 2, 0); }, ErrorKind::Shape, {"qk_rmsnorm_forward", "n_kv_head 0"});
  expect_error([&] { fwd(r, N * 3, w_big, D + 1, 2, 1); }, ErrorKind::Shape, {"qk_rmsnorm_forward", "k_w"});
  expect_error([&] { fwd(r_small, N * 2, w, D, 2, 1); }, ErrorKind::Shape, {"qk_rmsnorm_forward", "rstd"});
  expect_error([&] {
    qk_rmsnorm_forward(ctx, view(out, {N, W}), view(r, {N * 3}), view(qkv, {N, W}), view(w, {D}), view(w, {D}), 2, 1,
                       -1.0);
  }, ErrorKind::Shape, {"qk_rmsnorm_forward", "eps"});
  // rstd is F32 beside bf16 activations; dq_w is bf16 or f32, not f16.
  expect_error([&] {
    qk_rmsnorm_forward(ctx, view(qkv16, {N, W}), view(r16, {N * 3}), view(qkv16, {N, W}), view(w16, {D}),
                       view(w16, {D}), 2, 1, 1e-6);
  }, ErrorKind::Shape, {"qk_rmsnorm_forward", "rstd", "f32"});
  expect_error([&] {
    qk_rmsnorm_backward(ctx, view(qkv16, {N, W}), view(dw_f16, {D}), view(w16, {D}), view(qkv16, {N, W}),
                        view(qkv16, {N, W}), view(w16, {D}), view(w16, {D}), view(r32, {N * 3}), 2, 1,
                        GradMode::Overwrite);
  }, ErrorKind::Shape, {"qk_rmsnorm_backward", "dq_w"});
  // Accumulating into the gradient being read is refused.
  expect_error([&] {
    qk_rmsnorm_backward(ctx, view(out, {N, W}), view(dq, {D}), view(dk, {D}), view(out, {N, W}), view(qkv, {N, W}),
                        view(w, {D}), view(w, {D}), view(r, {N * 3}), 2, 1, GradMode::Accumulate);
  }, ErrorKind::Shape, {"qk_rmsnorm_backward", "dout"});
}

// Under metrics.op_profile every call counts once as a norm.
TEST(QkNormProfile, CountsAsNorm) {
  Timeline tl;
  tl.set_profiling(true);
  KernelContext ctx;
  ctx.timeline = &tl;
  const int64_t N = 3, D = 8, W = 4 * D;
  std::vector<float> qkv = cast_vec<float>(randn(N * W, 2671)), w(D, 1.0f), out(N * W), r(N * 3), dx(N * W), dq(D),
                     dk(D);
  qk_rmsnorm_forward(ctx, view(out, {N, W}), view(r, {N * 3}), view(qkv, {N, W}), view(w, {D}), view(w, {D}), 2, 1,
                     kNormEps);
  qk_rmsnorm_backward(ctx, view(dx, {N, W}), view(dq, {D}), view(dk, {D}), view(out, {N, W}), view(qkv, {N, W}),
                      view(w, {D}), view(w, {D}), view(r, {N * 3}), 2, 1, GradMode::Overwrite);
  const OpTimes ops = tl.take_ops();
  EXPECT_EQ(ops.calls[int(OpKind::Norm)], 2);
  EXPECT_EQ(ops.calls[int(OpKind::Elementwise)], 0);
}

}  // namespace
}  // namespace xirang::test
