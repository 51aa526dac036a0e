// Tests for the flash-style pair of kernels/attention.h (lse saved, the
// probabilities recomputed in backward) against the probability-based pair
// and the float64 reference, a finite-difference check of its F64 backward,
// and both pairs with BF16 and F16 storage.
//
// Tolerances.
// - F64: the flash and probability-based kernels compute the same sums in
//   another order (lse and delta = dO . O instead of sum_j p_j dP_j): 1e-12.
// - F32: 1e-5 against the float64 reference, as attention_test.cc argues
//   (D = 16 term dot products, softmax over <= 13 entries); against the F32
//   probability-based kernel 2e-6, the two being fp32 computations of the
//   same values that differ only in rounding (a few ulp of O(1) numbers).
// - lse: max + log of a double sum of exps, one fp32 rounding of an O(1)
//   number, plus fp32 scores: 1e-5 absolute against a float64 log-sum-exp.
// - 16-bit (u = 2^-8 bf16, 2^-11 f16; inputs rounded to S first): out is
//   formed in float and rounded once, 2u of the scale, >= 97% exactly
//   rounded. dqkv is accumulated in float and rounded once (u), but backward
//   reads the stored (rounded) out for delta = dO . O, which moves each dS
//   by up to p u |dO| |O| relative; the gradients are sums of such terms
//   weighted by |k| or |q| (O(1)), so the error is a few u of their scale:
//   the tolerance is 4u. With F32 probabilities the probability-based
//   backward has no such term (2u); with 16-bit probabilities each p carries
//   u of error into dv and dS alike: 4u.
#include <omp.h>

#include <array>
#include <cmath>

#include "kernels/attention.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

struct AttnShape {
  int64_t B, T, C, H;
};

// log sum_s exp(scale q_t . k_s) over s <= t, in float64: (B, H, T).
Vec ref_lse(const Vec& qkv, const AttnShape& a) {
  const int64_t D = a.C / a.H, C3 = 3 * a.C;
  const double scale = 1.0 / std::sqrt(double(D));
  Vec r(a.B * a.H * a.T);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.H; ++h)
      for (int64_t t = 0; t < a.T; ++t) {
        Vec s(t + 1);
        double mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qkv[(b * a.T + t) * C3 + h * D + d] * qkv[(b * a.T + j) * C3 + a.C + h * D + d];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (double v : s) z += std::exp(v - mx);
        r[(b * a.H + h) * a.T + t] = mx + std::log(z);
      }
  return r;
}

template <class S, class St>
struct FlashRun {
  std::vector<S> out, dqkv;
  std::vector<St> lse;
};

// Flash forward then backward into outputs pre-filled with random values.
template <class S, class St = std::conditional_t<is_16bit_v<S>, float, S>>
FlashRun<S, St> run_flash(const std::vector<S>& qkv_in, const std::vector<S>& dout_in, const AttnShape& a) {
  KernelContext ctx;
  auto qkv = qkv_in, dout = dout_in;
  FlashRun<S, St> r{cast_vec<S>(randn(a.B * a.T * a.C, 1501)), cast_vec<S>(randn(a.B * a.T * 3 * a.C, 1502)),
                    cast_vec<St>(randn(a.B * a.H * a.T, 1503))};
  flash_attention_forward(ctx, view(r.out, {a.B, a.T, a.C}), view(r.lse, {a.B, a.H, a.T}), view(qkv, {a.B, a.T, 3 * a.C}),
                          int(a.H));
  flash_attention_backward(ctx, view(r.dqkv, {a.B, a.T, 3 * a.C}), view(dout, {a.B, a.T, a.C}),
                           view(qkv, {a.B, a.T, 3 * a.C}), view(r.out, {a.B, a.T, a.C}), view(r.lse, {a.B, a.H, a.T}),
                           int(a.H));
  return r;
}

// The probability-based pair, probabilities stored as P.
template <class S, class P>
std::pair<std::vector<S>, std::vector<S>> run_probs(const std::vector<S>& qkv_in, const std::vector<S>& dout_in,
                                                    const AttnShape& a) {
  KernelContext ctx;
  auto qkv = qkv_in, dout = dout_in;
  auto out = cast_vec<S>(randn(a.B * a.T * a.C, 1504));
  auto probs = cast_vec<P>(randn(a.B * a.H * a.T * a.T, 1505));
  auto dqkv = cast_vec<S>(randn(a.B * a.T * 3 * a.C, 1506));
  attention_forward(ctx, view(out, {a.B, a.T, a.C}), view(probs, {a.B, a.H, a.T, a.T}), view(qkv, {a.B, a.T, 3 * a.C}),
                    int(a.H));
  attention_backward(ctx, view(dqkv, {a.B, a.T, 3 * a.C}), view(dout, {a.B, a.T, a.C}), view(qkv, {a.B, a.T, 3 * a.C}),
                     view(probs, {a.B, a.H, a.T, a.T}), int(a.H));
  return {out, dqkv};
}

// Odd sizes: T = 13, D = 16; D = 5 with 3 heads; one head; one token.
const AttnShape kShapes[] = {{2, 13, 48, 3}, {3, 11, 15, 3}, {2, 9, 8, 1}, {2, 1, 12, 4}};

template <class T>
class FlashWideTest : public ::testing::Test {};
using Wide = ::testing::Types<float, double>;
TYPED_TEST_SUITE(FlashWideTest, Wide);

TYPED_TEST(FlashWideTest, MatchesProbabilityAttentionAndReference) {
  using T = TypeParam;
  const bool f64 = std::is_same_v<T, double>;
  for (const AttnShape& a : kShapes) {
    SCOPED_TRACE(testing::Message() << "B " << a.B << " T " << a.T << " C " << a.C << " H " << a.H);
    auto qkv = cast_vec<T>(randn(a.B * a.T * 3 * a.C, 1511 + a.C));
    auto dout = cast_vec<T>(randn(a.B * a.T * a.C, 1512 + a.C));
    auto fl = run_flash(qkv, dout, a);
    auto [p_out, p_dqkv] = run_probs<T, T>(qkv, dout, a);
    expect_near(fl.out, to_f64(p_out), f64 ? 1e-12 : 2e-6, "out vs probability attention");
    expect_near(fl.dqkv, to_f64(p_dqkv), f64 ? 1e-12 : 2e-6, "dqkv vs probability attention");
    AttentionOut r = ref_attention_forward(to_f64(qkv), a.B, a.T, a.C, a.H);
    expect_near(fl.out, r.out, f64 ? 1e-12 : 1e-5, "out vs reference");
    expect_near(fl.dqkv, ref_attention_backward(to_f64(dout), to_f64(qkv), a.B, a.T, a.C, a.H), f64 ? 1e-12 : 1e-5,
                "dqkv vs reference");
    expect_near(fl.lse, ref_lse(to_f64(qkv), a), f64 ? 1e-12 : 1e-5, "lse vs float64 log-sum-exp");
  }
}

// Scores far from 0 (q and k of scale 4: |s| up to ~30) overflow exp()
// unless the row max is subtracted; lse itself is then large, so it is
// compared relative to its own size.
TYPED_TEST(FlashWideTest, LargeScoresStayFinite) {
  using T = TypeParam;
  const AttnShape a{1, 12, 16, 2};
  auto qkv = cast_vec<T>(randn(a.B * a.T * 3 * a.C, 1521, 4.0));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C, 1522));
  auto fl = run_flash(qkv, dout, a);
  const double t = tol<T>(1e-5);
  expect_near(fl.out, ref_attention_forward(to_f64(qkv), a.B, a.T, a.C, a.H).out, t, "out");
  expect_near(fl.lse, ref_lse(to_f64(qkv), a), t, "lse");
  // Scores this peaked make the softmax backward cancel more: compare at 10x.
  expect_near(fl.dqkv, ref_attention_backward(to_f64(dout), to_f64(qkv), a.B, a.T, a.C, a.H), 10 * t, "dqkv");
}

// Results do not depend on the thread count (one task per (batch, head)).
TYPED_TEST(FlashWideTest, IndependentOfThreadCount) {
  using T = TypeParam;
  const AttnShape a{3, 10, 24, 4};
  auto qkv = cast_vec<T>(randn(a.B * a.T * 3 * a.C, 1531));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C, 1532));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto one = run_flash(qkv, dout, a);
  omp_set_num_threads(3);
  auto three = run_flash(qkv, dout, a);
  omp_set_num_threads(saved);
  EXPECT_EQ(one.out, three.out);
  EXPECT_EQ(one.lse, three.lse);
  EXPECT_EQ(one.dqkv, three.dqkv);
}

// Long rows for the blocked F32 path (query blocks of 32 rows, key columns
// padded to 16, head width padded to 16): T = 200 (six full blocks and one
// of 8 rows, T not a multiple of 16) with D = 64, and T = 131 with D = 20.
// Same tolerances as the short shapes: each output is still one fp32
// computation of O(1) values, now with 64-term dot products and up to
// 200-term sums over keys (relative rounding ~sqrt(n) u, under 1e-6).
TEST(FlashLongTest, ManyQueryBlocksAgainstReference) {
  for (const AttnShape& a : {AttnShape{2, 200, 128, 2}, AttnShape{1, 131, 40, 2}}) {
    SCOPED_TRACE(testing::Message() << "B " << a.B << " T " << a.T << " C " << a.C << " H " << a.H);
    auto qkv = cast_vec<float>(randn(a.B * a.T * 3 * a.C, 1541 + a.T));
    auto dout = cast_vec<float>(randn(a.B * a.T * a.C, 1542 + a.T));
    auto fl = run_flash(qkv, dout, a);
    expect_near(fl.out, ref_attention_forward(to_f64(qkv), a.B, a.T, a.C, a.H).out, 1e-5, "out");
    expect_near(fl.lse, ref_lse(to_f64(qkv), a), 1e-5, "lse");
    expect_near(fl.dqkv, ref_attention_backward(to_f64(dout), to_f64(qkv), a.B, a.T, a.C, a.H), 1e-5, "dqkv");
  }
}

// Bitwise the same with 1 and 3 threads over several query blocks, F32 and BF16.
template <class T>
class FlashLongThreads : public ::testing::Test {};
using LongTypes = ::testing::Types<float, bf16>;
TYPED_TEST_SUITE(FlashLongThreads, LongTypes);

TYPED_TEST(FlashLongThreads, IndependentOfThreadCount) {
  using T = TypeParam;
  const AttnShape a{3, 150, 128, 2};
  auto qkv = cast_vec<T>(randn(a.B * a.T * 3 * a.C, 1551));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C, 1552));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto one = run_flash(qkv, dout, a);
  omp_set_num_threads(3);
  auto three = run_flash(qkv, dout, a);
  omp_set_num_threads(saved);
  EXPECT_EQ(to_f64(one.out), to_f64(three.out));  // exact widenings: a bitwise comparison
  EXPECT_EQ(to_f64(one.lse), to_f64(three.lse));
  EXPECT_EQ(to_f64(one.dqkv), to_f64(three.dqkv));
}

// Central differences of L = sum(out * R) in float64 against the kernel's
// F64 flash backward with dout = R, over every element of qkv (the forward
// recomputed for each perturbation). h = 1e-6: truncation ~1e-12, roundoff
// ~1e-16 |L| / h ~ 1e-9; the norm-wise bound is 1e-6.
TEST(FlashAttentionGradCheck, FiniteDifferences) {
  const AttnShape a{2, 6, 12, 3};
  const double h = 1e-6;
  KernelContext ctx;
  Vec qkv = randn(a.B * a.T * 3 * a.C, 1541), R = randn(a.B * a.T * a.C, 1542);
  Vec out(a.B * a.T * a.C), lse(a.B * a.H * a.T);
  auto loss = [&]() {
    flash_attention_forward(ctx, view(out, {a.B, a.T, a.C}), view(lse, {a.B, a.H, a.T}), view(qkv, {a.B, a.T, 3 * a.C}),
                            int(a.H));
    double L = 0;
    for (size_t i = 0; i < out.size(); ++i) L += out[i] * R[i];
    return L;
  };
  loss();
  Vec dqkv(qkv.size());
  flash_attention_backward(ctx, view(dqkv, {a.B, a.T, 3 * a.C}), view(R, {a.B, a.T, a.C}), view(qkv, {a.B, a.T, 3 * a.C}),
                           view(out, {a.B, a.T, a.C}), view(lse, {a.B, a.H, a.T}), int(a.H));
  EXPECT_LT(normwise_error(numeric_gradient(qkv, h, loss), dqkv), 1e-6);
}

// ---------------------------------------------------------------- 16-bit storage

template <class S>
class Attention16Test : public ::testing::Test {};
using Storage16 = ::testing::Types<bf16, f16>;
TYPED_TEST_SUITE(Attention16Test, Storage16);

TYPED_TEST(Attention16Test, FlashAgainstReference) {
  using S = TypeParam;
  const double u = unit_roundoff<S>();
  for (const AttnShape& a : kShapes) {
    SCOPED_TRACE(testing::Message() << "B " << a.B << " T " << a.T << " C " << a.C << " H " << a.H);
    auto qkv = cast_vec<S>(randn(a.B * a.T * 3 * a.C, 1551 + a.C));
    auto dout = cast_vec<S>(randn(a.B * a.T * a.C, 1552 + a.C));
    auto fl = run_flash(qkv, dout, a);
    Vec ref_out = ref_attention_forward(to_f64(qkv), a.B, a.T, a.C, a.H).out;
    expect_near(fl.out, ref_out, 2 * u, "out");
    expect_mostly_rounded(fl.out, ref_out, 0.97, "out");
    expect_near(fl.lse, ref_lse(to_f64(qkv), a), 1e-5, "lse (f32)");
    expect_near(fl.dqkv, ref_attention_backward(to_f64(dout), to_f64(qkv), a.B, a.T, a.C, a.H), 4 * u, "dqkv");
  }
}

TYPED_TEST(Attention16Test, ProbabilityPairAgainstReference) {
  using S = TypeParam;
  const double u = unit_roundoff<S>();
  const AttnShape a = kShapes[0];
  auto qkv = cast_vec<S>(randn(a.B * a.T * 3 * a.C, 1561));
  auto dout = cast_vec<S>(randn(a.B * a.T * a.C, 1562));
  Vec ref_out = ref_attention_forward(to_f64(qkv), a.B, a.T, a.C, a.H).out;
  Vec ref_d = ref_attention_backward(to_f64(dout), to_f64(qkv), a.B, a.T, a.C, a.H);
  {
    SCOPED_TRACE("f32 probabilities");
    auto [out, dqkv] = run_probs<S, float>(qkv, dout, a);
    expect_near(out, ref_out, 2 * u, "out");
    expect_mostly_rounded(out, ref_out, 0.97, "out");
    expect_near(dqkv, ref_d, 2 * u, "dqkv");
    expect_mostly_rounded(dqkv, ref_d, 0.9, "dqkv");
  }
  {
    SCOPED_TRACE("16-bit probabilities");
    auto [out, dqkv] = run_probs<S, S>(qkv, dout, a);
    expect_near(out, ref_out, 2 * u, "out");
    expect_near(dqkv, ref_d, 4 * u, "dqkv");
  }
}

TEST(FlashAttentionErrors, LseShapeAndDtype) {
  KernelContext ctx;
  const int64_t B = 1, T = 4, C = 12, H = 3;
  std::vector<bf16> qkv(B * T * 3 * C), out(B * T * C), lse16(B * H * T);
  std::vector<float> lse(B * H * T), lse_short(B * H * (T - 1));
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, C}), view(lse16, {B, H, T}), view(qkv, {B, T, 3 * C}), int(H));
  }, ErrorKind::Shape, {"flash_attention_forward", "lse", "f32"});
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, C}), view(lse_short, {B, H, T - 1}), view(qkv, {B, T, 3 * C}), int(H));
  }, ErrorKind::Shape, {"flash_attention_forward", "lse"});
  std::vector<double> dout64(B * T * C);
  std::vector<bf16> dqkv(B * T * 3 * C);
  expect_error([&] {
    flash_attention_backward(ctx, view(dqkv, {B, T, 3 * C}), view(dout64, {B, T, C}), view(qkv, {B, T, 3 * C}),
                             view(out, {B, T, C}), view(lse, {B, H, T}), int(H));
  }, ErrorKind::Shape, {"flash_attention_backward", "dout"});
}

}  // namespace
}  // namespace xirang::test
