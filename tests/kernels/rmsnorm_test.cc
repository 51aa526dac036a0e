// Tests for kernels/rmsnorm.h against a float64 reference written from the
// formula, in every storage dtype, with a finite-difference check of the
// float64 backward and the fused residual form against add() + rmsnorm.
//
// Tolerances, as max |got - ref| <= tol * max(1, max |ref|):
// - F32: 1e-5. The sum of squares is in double; y = (x rstd) w carries two
//   float roundings (~1e-7 relative); dx sums C = 48 products in double and
//   rounds once; dw sums N = 37 rows in double. 1e-5 keeps a 10x margin
//   over anything a correct kernel does, and a wrong eps or formula is off
//   by 1e-3 or more.
// - F64: 1e-10 (only the summation order differs from the reference).
// - BF16/F16: 2u (u = 2^-8, 2^-11): inputs are the rounded values the
//   reference also reads, each output is formed in float or double and
//   rounded once, so it is within u of the scale; and >= 97% of the
//   elements must equal the reference rounded once (a double rounding or a
//   16-bit accumulation misses far more). rstd is F32 (1e-5), and F32 dw
//   beside 16-bit activations keeps the F32 tolerance.
#include <omp.h>

#include <cmath>

#include "kernels/elementwise.h"
#include "kernels/rmsnorm.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;
constexpr double kMinRounded = 0.97;
constexpr double kNormEps = 1e-5;  // Llama 3's norm_eps

struct RmsNormOut {
  Vec y, rstd;  // (N, C), (N)
};

// y = x / sqrt(mean(x^2) + eps) * w, straight from the definition.
RmsNormOut ref_rmsnorm_forward(const Vec& x, const Vec& w, int64_t N, int64_t C, double eps) {
  RmsNormOut r{Vec(N * C), Vec(N)};
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c];
    ms /= double(C);
    r.rstd[n] = 1.0 / std::sqrt(ms + eps);
    for (int64_t c = 0; c < C; ++c) r.y[n * C + c] = x[n * C + c] / std::sqrt(ms + eps) * w[c];
  }
  return r;
}

struct RmsNormGrads {
  Vec dx, dw;  // (N, C), (C): the gradients alone
};

// With r = (m + eps)^(-1/2), m = sum_j x_j^2 / C: dr/dx_k = -r^3 x_k / C, so
// dL/dx_k = r dy_k w_k - (r^3 x_k / C) sum_j dy_j w_j x_j; dL/dw_k = sum_n dy_k x_k r.
RmsNormGrads ref_rmsnorm_backward(const Vec& dy, const Vec& x, const Vec& w, int64_t N, int64_t C, double eps) {
  RmsNormGrads g{Vec(N * C), Vec(C, 0.0)};
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0, dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      ms += x[n * C + c] * x[n * C + c];
      dot += dy[n * C + c] * w[c] * x[n * C + c];
    }
    const double r = 1.0 / std::sqrt(ms / double(C) + eps);
    for (int64_t c = 0; c < C; ++c) {
      g.dx[n * C + c] = r * dy[n * C + c] * w[c] - r * r * r * x[n * C + c] * dot / double(C);
      g.dw[c] += dy[n * C + c] * x[n * C + c] * r;
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
class RmsNormTest : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, C = 48;
  KernelContext ctx;
  // Rows with a non-zero mean and scale 2, w around 1: every term matters.
  std::vector<S> x = cast_vec<S>(randn(N * C, 2101, 2.0, 0.5));
  std::vector<S> w = cast_vec<S>(randn(C, 2102, 0.5, 1.0));
  std::vector<S> dy = cast_vec<S>(randn(N * C, 2103));

  // The kernel forward on fresh random outputs.
  void forward(std::vector<S>& y, std::vector<stat_t<S>>& rstd, double eps = kNormEps) {
    y = cast_vec<S>(randn(N * C, 2104));
    rstd = cast_vec<stat_t<S>>(randn(N, 2105));
    rmsnorm_forward(ctx, view(y, {N, C}), view(rstd, {N}), view(x, {N, C}), view(w, {C}), eps);
  }
};
using AllStorage = ::testing::Types<float, double, bf16, f16>;
TYPED_TEST_SUITE(RmsNormTest, AllStorage);

TYPED_TEST(RmsNormTest, Forward) {
  using S = TypeParam;
  auto& f = *this;
  std::vector<S> y;
  std::vector<stat_t<S>> rstd;
  f.forward(y, rstd);
  RmsNormOut r = ref_rmsnorm_forward(to_f64(f.x), to_f64(f.w), f.N, f.C, kNormEps);
  expect_near(y, r.y, tolerance<S>(), "y");
  expect_near(rstd, r.rstd, tol<stat_t<S>>(kTolF32), "rstd");
  if constexpr (is_16bit_v<S>) expect_mostly_rounded(y, r.y, kMinRounded, "y");
}

// Rows of scale 3e-3 (mean square ~1e-5, the size of eps): eps is then half
// of the denominator, so putting it outside the square root, adding it to
// the sum rather than the mean, or ignoring the eps argument (1e-6 here, not
// the usual 1e-5) moves y by 10% or more. rstd ~ 200: compared relative to
// its own size.
TYPED_TEST(RmsNormTest, SmallRowsUseEps) {
  using S = TypeParam;
  auto& f = *this;
  f.x = cast_vec<S>(randn(f.N * f.C, 2111, 3e-3));
  for (double eps : {1e-5, 1e-6}) {
    SCOPED_TRACE(eps);
    std::vector<S> y;
    std::vector<stat_t<S>> rstd;
    f.forward(y, rstd, eps);
    RmsNormOut r = ref_rmsnorm_forward(to_f64(f.x), to_f64(f.w), f.N, f.C, eps);
    expect_near(y, r.y, tolerance<S>(), "y");
    Vec got = to_f64(rstd), want = r.rstd;
    for (size_t i = 0; i < got.size(); ++i) got[i] /= want[i], want[i] = 1.0;
    expect_near(got, want, tol<stat_t<S>>(kTolF32), "rstd / reference rstd");
  }
}

// dx in both modes on random prior contents; dw always accumulates, in S
// and (16-bit) in F32 over two microbatches.
TYPED_TEST(RmsNormTest, Backward) {
  using S = TypeParam;
  using St = stat_t<S>;
  auto& f = *this;
  std::vector<S> y;
  std::vector<St> rstd;
  f.forward(y, rstd);
  RmsNormGrads g = ref_rmsnorm_backward(to_f64(f.dy), to_f64(f.x), to_f64(f.w), f.N, f.C, kNormEps);
  for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate}) {
    SCOPED_TRACE(mode == GradMode::Overwrite ? "Overwrite" : "Accumulate");
    auto dx = cast_vec<S>(randn(f.N * f.C, 2121));
    auto dw = cast_vec<S>(randn(f.C, 2122));
    Vec dx0 = to_f64(dx), dw0 = to_f64(dw);
    rmsnorm_backward(f.ctx, view(dx, {f.N, f.C}), view(dw, {f.C}), view(f.dy, {f.N, f.C}), view(f.x, {f.N, f.C}),
                     view(f.w, {f.C}), view(rstd, {f.N}), mode);
    Vec want_dx = mode == GradMode::Overwrite ? g.dx : plus(dx0, g.dx);
    expect_near(dx, want_dx, tolerance<S>(), "dx");
    expect_near(dw, plus(dw0, g.dw), tolerance<S>(), "dw");
    if constexpr (is_16bit_v<S>) expect_mostly_rounded(dx, want_dx, kMinRounded, "dx");
  }
  if constexpr (is_16bit_v<S>) {
    auto dx = cast_vec<S>(randn(f.N * f.C, 2123));
    auto dw = cast_vec<float>(randn(f.C, 2124));
    Vec want = to_f64(dw);
    for (int micro = 0; micro < 2; ++micro) {
      rmsnorm_backward(f.ctx, view(dx, {f.N, f.C}), view(dw, {f.C}), view(f.dy, {f.N, f.C}), view(f.x, {f.N, f.C}),
                       view(f.w, {f.C}), view(rstd, {f.N}), GradMode::Overwrite);
      want = plus(want, g.dw);
    }
    expect_near(dw, want, kTolF32, "f32 dw");
  }
}

// res = a + b, y = RMSNorm(res) against add() then rmsnorm_forward(): bitwise
// in every dtype, also with res aliasing a (the residual stream updated in
// place) and aliasing b. Odd sizes: 29 rows of 37.
TYPED_TEST(RmsNormTest, ResidualMatchesUnfusedBitwise) {
  using S = TypeParam;
  using St = stat_t<S>;
  const int64_t N = 29, C = 37;
  KernelContext ctx;
  auto a = cast_vec<S>(randn(N * C, 2131, 1.5, 0.2));
  auto b = cast_vec<S>(randn(N * C, 2132));
  auto w = cast_vec<S>(randn(C, 2133, 0.5, 1.0));
  auto res_ref = cast_vec<S>(randn(N * C, 2134));
  auto y_ref = cast_vec<S>(randn(N * C, 2135));
  auto r_ref = cast_vec<St>(randn(N, 2136));
  add(ctx, view(res_ref, {N, C}), view(a, {N, C}), view(b, {N, C}));
  rmsnorm_forward(ctx, view(y_ref, {N, C}), view(r_ref, {N}), view(res_ref, {N, C}), view(w, {C}), kNormEps);
  for (int alias = 0; alias < 3; ++alias) {
    SCOPED_TRACE(alias == 0 ? "separate res" : alias == 1 ? "res aliases a" : "res aliases b");
    auto a_in = a, b_in = b;
    auto res = cast_vec<S>(randn(N * C, 2137));
    auto y = cast_vec<S>(randn(N * C, 2138));
    auto r = cast_vec<St>(randn(N, 2139));
    std::vector<S>& res_out = alias == 0 ? res : alias == 1 ? a_in : b_in;
    residual_rmsnorm_forward(ctx, view(res_out, {N, C}), view(y, {N, C}), view(r, {N}), view(a_in, {N, C}),
                             view(b_in, {N, C}), view(w, {C}), kNormEps);
    EXPECT_EQ(bytes_of(res_out), bytes_of(res_ref)) << "res";
    EXPECT_EQ(bytes_of(y), bytes_of(y_ref)) << "y";
    EXPECT_EQ(bytes_of(r), bytes_of(r_ref)) << "rstd";
  }
  if constexpr (!is_16bit_v<S>) {
    RmsNormOut want = ref_rmsnorm_forward(plus(to_f64(a), to_f64(b)), to_f64(w), N, C, kNormEps);
    expect_near(y_ref, want.y, tol<S>(kTolF32), "y against the reference");
  }
}

// dw sums rows in fixed chunks added in order, so dx and dw are bitwise the
// same whatever the thread count (a rank's result must not depend on it).
// In F64, where a different summation order would show in the last bits.
TEST(RmsNormDeterminism, IndependentOfThreadCount) {
  const int64_t N = 101, C = 24;
  KernelContext ctx;
  const Vec x = randn(N * C, 2161, 1.5), w = randn(C, 2162, 0.5, 1.0), dy = randn(N * C, 2163);
  Vec y(N * C), r(N);
  auto xv = x, wv = w, dyv = dy;
  rmsnorm_forward(ctx, view(y, {N, C}), view(r, {N}), view(xv, {N, C}), view(wv, {C}), kNormEps);
  const int saved = omp_get_max_threads();
  std::vector<std::vector<uint8_t>> dx_bytes, dw_bytes;
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    Vec dx(N * C), dw = randn(C, 2164);
    rmsnorm_backward(ctx, view(dx, {N, C}), view(dw, {C}), view(dyv, {N, C}), view(xv, {N, C}), view(wv, {C}),
                     view(r, {N}), GradMode::Overwrite);
    dx_bytes.push_back(bytes_of(dx));
    dw_bytes.push_back(bytes_of(dw));
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(dx_bytes[0], dx_bytes[1]) << "dx";
  EXPECT_EQ(dw_bytes[0], dw_bytes[1]) << "dw";
}

// Central differences on L = sum(y * R), float64, against the kernel's own
// F64 backward (dy = R); h = 1e-6 (tests/kernels/gradcheck.h). Rows of
// scale 0.05 make eps 4% of the mean square, so its gradient path counts.
TEST(RmsNormGradCheck, FiniteDifferences) {
  const int64_t N = 5, C = 16;
  const double h = 1e-6;
  KernelContext ctx;
  for (double scale : {1.5, 0.05}) {
    SCOPED_TRACE(scale);
    Vec x = randn(N * C, 2141, scale, 0.1 * scale), w = randn(C, 2142, 0.5, 1.0), R = randn(N * C, 2143);
    Vec y(N * C), rstd(N);
    auto loss = [&]() {
      rmsnorm_forward(ctx, view(y, {N, C}), view(rstd, {N}), view(x, {N, C}), view(w, {C}), kNormEps);
      double L = 0;
      for (int64_t i = 0; i < N * C; ++i) L += y[i] * R[i];
      return L;
    };
    loss();
    Vec dx(N * C), dw(C, 0.0);
    rmsnorm_backward(ctx, view(dx, {N, C}), view(dw, {C}), view(R, {N, C}), view(x, {N, C}), view(w, {C}),
                     view(rstd, {N}), GradMode::Overwrite);
    EXPECT_LT(normwise_error(numeric_gradient(x, h, loss), dx), 1e-6) << "dx";
    EXPECT_LT(normwise_error(numeric_gradient(w, h, loss), dw), 1e-6) << "dw";
  }
}

TEST(RmsNormErrors, ShapesAndDtypes) {
  KernelContext ctx;
  const int64_t N = 4, C = 8;
  std::vector<float> x(N * C, 1.0f), y(N * C), dy(N * C, 1.0f), dx(N * C), w(C, 1.0f), w_big(C + 1), r(N, 1.0f),
      r_big(N + 1), dw(C);
  std::vector<bf16> x16(N * C), y16(N * C), w16(C), r16(N), dx16(N * C), dy16(N * C);
  std::vector<f16> dw_f16(C);
  std::vector<float> r32(N);
  expect_error([&] { rmsnorm_forward(ctx, view(y, {N, C}), view(r, {N}), view(x, {N, C}), view(w_big, {C + 1}), 1e-5); },
               ErrorKind::Shape, {"rmsnorm_forward", "w"});
  expect_error([&] { rmsnorm_forward(ctx, view(y, {N, C}), view(r, {N}), view(x, {N, C}), view(w, {C}), -1.0); },
               ErrorKind::Shape, {"rmsnorm_forward", "eps"});
  expect_error([&] {
    rmsnorm_backward(ctx, view(dx, {N, C}), view(dw, {C}), view(dy, {N, C}), view(x, {N, C}), view(w, {C}),
                     view(r_big, {N + 1}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"rmsnorm_backward", "rstd"});
  // rstd is F32 beside bf16 activations; dw is bf16 or f32, not f16.
  expect_error([&] {
    rmsnorm_forward(ctx, view(y16, {N, C}), view(r16, {N}), view(x16, {N, C}), view(w16, {C}), 1e-5);
  }, ErrorKind::Shape, {"rmsnorm_forward", "rstd", "f32"});
  expect_error([&] {
    rmsnorm_backward(ctx, view(dx16, {N, C}), view(dw_f16, {C}), view(dy16, {N, C}), view(x16, {N, C}),
                     view(w16, {C}), view(r32, {N}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"rmsnorm_backward", "dw"});
  expect_error([&] {
    residual_rmsnorm_forward(ctx, view(x16, {N, C}), view(y16, {N, C}), view(r32, {N}), view(x16, {N, C}),
                             view(x, {N, C}), view(w16, {C}), 1e-5);
  }, ErrorKind::Shape, {"residual_rmsnorm_forward", "b"});
}

// Under metrics.op_profile every call counts once as a norm, the fused
// residual form included.
TEST(RmsNormProfile, CountsAsNorm) {
  Timeline tl;
  tl.set_profiling(true);
  KernelContext ctx;
  ctx.timeline = &tl;
  const int64_t N = 3, C = 8;
  std::vector<float> x = cast_vec<float>(randn(N * C, 2151)), w(C, 1.0f), y(N * C), r(N), dx(N * C), dw(C);
  rmsnorm_forward(ctx, view(y, {N, C}), view(r, {N}), view(x, {N, C}), view(w, {C}), kNormEps);
  residual_rmsnorm_forward(ctx, view(y, {N, C}), view(y, {N, C}), view(r, {N}), view(x, {N, C}), view(x, {N, C}),
                           view(w, {C}), kNormEps);
  rmsnorm_backward(ctx, view(dx, {N, C}), view(dw, {C}), view(y, {N, C}), view(x, {N, C}), view(w, {C}),
                   view(r, {N}), GradMode::Overwrite);
  const OpTimes ops = tl.take_ops();
  EXPECT_EQ(ops.calls[int(OpKind::Norm)], 3);
  EXPECT_EQ(ops.calls[int(OpKind::Elementwise)], 0);
}

}  // namespace
}  // namespace xirang::test
