// Tests for kernels/matmul.h with BF16 and F16 storage (fp32 compute), with
// F32 parameter gradients beside 16-bit activations, and for the fused
// linear + GELU pair against its unfused composition.
//
// Inputs are rounded to the 16-bit type first and the float64 reference is
// computed from those exact values, so the only 16-bit error left is the
// final rounding of each stored output: at most u |y| with u = 2^-8 (bf16)
// or 2^-11 (f16), i.e. u of the max(1, max|ref|) scale. The float arithmetic
// in between is ~1e-6 of the scale (K <= 48 term sums, see matmul_test.cc).
// The tolerance is 2u: a 2x margin over one rounding, while an output
// rounded twice through a long 16-bit sum, or a tile written to the wrong
// place, is off by many u. expect_mostly_rounded() then asks that >= 97% of
// the elements equal the reference rounded once.
//
// F32 gradient outputs get no 16-bit rounding at all: they must agree with
// the reference to the fp32 tolerance of matmul_test.cc (1e-5), and most of
// their elements must not be representable in 16 bits.
#include <array>
#include <cmath>

#include "kernels/cpu/gemm_16bit.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;
constexpr double kMinRounded = 0.97;

template <class S>
constexpr double tol16() {
  return 2 * unit_roundoff<S>();
}

template <class S>
class Matmul16Test : public ::testing::Test {};
using Storage16 = ::testing::Types<bf16, f16>;
TYPED_TEST_SUITE(Matmul16Test, Storage16);

// out = alpha op(a) op(b) + beta out over an M x N x K problem, with every
// operand rounded to S first.
template <class S>
void check_matmul(int64_t M, int64_t N, int64_t K, bool ta, bool tb, double alpha, double beta, uint64_t seed,
                  double min_rounded) {
  SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " trans_a " << ta << " trans_b " << tb);
  KernelContext ctx;
  auto a = cast_vec<S>(randn(M * K, seed));
  auto b = cast_vec<S>(randn(K * N, seed + 1));
  auto out = cast_vec<S>(randn(M * N, seed + 2));
  // ref_matmul on pre-transposed copies (op(a) and op(b)^T, both row-major
  // over K): the same reference, with unit-stride inner loops for large K.
  Vec ar = to_f64(a), br = to_f64(b), opa(M * K), opbt(N * K);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) opa[i * K + k] = ta ? ar[k * M + i] : ar[i * K + k];
  for (int64_t j = 0; j < N; ++j)
    for (int64_t k = 0; k < K; ++k) opbt[j * K + k] = tb ? br[j * K + k] : br[k * N + j];
  Vec ref = to_f64(out);
  ref_matmul(ref, opa, opbt, M, N, K, false, true, alpha, beta);
  matmul(ctx, view(out, {M, N}), view(a, ta ? Shape{K, M} : Shape{M, K}), view(b, tb ? Shape{N, K} : Shape{K, N}), ta,
         tb, alpha, beta);
  // Sums of K unit terms are ~sqrt(K) wide: compare against that scale.
  expect_near(out, ref, tol16<S>(), "matmul out");
  expect_mostly_rounded(out, ref, min_rounded, "matmul out");
}

TYPED_TEST(Matmul16Test, AllTransposesWithAlphaBeta) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) check_matmul<TypeParam>(37, 29, 48, ta, tb, 0.75, -0.625, 1001 + 2 * ta + tb, kMinRounded);
}

// K = 9000 > 4096: the public op sums five K tiles of 2048 into float and
// rounds once at the end. The long sum carries more float error (~sqrt(K)
// 2^-24 of the scale), so the rounded fraction is asked less strictly.
TYPED_TEST(Matmul16Test, LongInnerDimension) {
  check_matmul<TypeParam>(5, 7, 9000, false, false, 1.0, 0.5, 1011, 0.9);
  check_matmul<TypeParam>(5, 7, 9000, true, true, 1.0, 0.5, 1014, 0.9);
}

// The tiling itself, with tiles far smaller than the problem (3 rows, 4
// columns, 5 of K over 13 x 11 x 17, none dividing evenly) so that every
// path runs: several M, N and K tiles, partial edge tiles, transposed tile
// extraction, beta on a 16-bit output (loaded, scaled, rounded once), the
// bias broadcast, and an F32 output summed in place.
TYPED_TEST(Matmul16Test, SmallTilesCoverEveryPath) {
  using S = TypeParam;
  const int64_t M = 13, N = 11, K = 17;
  const cpu::GemmTiles tiles{3, 4, 5};
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(testing::Message() << "trans_a " << ta << " trans_b " << tb);
      auto a = cast_vec<S>(randn(M * K, 1031 + 2 * ta + tb));
      auto b = cast_vec<S>(randn(K * N, 1035 + 2 * ta + tb));
      auto bias = cast_vec<S>(randn(N, 1039));
      Vec ar = to_f64(a), br = to_f64(b);
      Vec prod(M * N, 0.0);
      ref_matmul(prod, ar, br, M, N, K, ta, tb, 1.0, 0.0);
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      // 16-bit output, alpha and beta.
      auto c16 = cast_vec<S>(randn(M * N, 1040));
      Vec want = to_f64(c16);
      for (int64_t i = 0; i < M * N; ++i) want[i] = 0.75 * prod[i] - 0.5 * want[i];
      cpu::gemm_16bit<S, S>(ta, tb, M, N, K, 0.75f, a.data(), lda, b.data(), ldb, -0.5f, c16.data(), N, nullptr, tiles);
      expect_near(c16, want, tol16<S>(), "16-bit C with beta");
      expect_mostly_rounded(c16, want, kMinRounded, "16-bit C with beta");
      // 16-bit output with the bias broadcast (beta 0: prior contents ignored).
      auto cb = cast_vec<S>(randn(M * N, 1041));
      Vec want_b(M * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) want_b[i * N + j] = prod[i * N + j] + as_double(bias[j]);
      cpu::gemm_16bit<S, S>(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, cb.data(), N, bias.data(), tiles);
      expect_near(cb, want_b, tol16<S>(), "16-bit C with bias");
      // F32 output accumulated in place (beta 1), no 16-bit rounding.
      auto c32 = cast_vec<float>(randn(M * N, 1042));
      Vec want32 = plus(to_f64(c32), prod);
      cpu::gemm_16bit<S, float>(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, c32.data(), N, nullptr,
                                tiles);
      expect_near(c32, want32, kTolF32, "f32 C");
    }
}

// The tile sizes the ops use: whole operands for the small products, and
// bounded scratch for the vocabulary head (4096 tokens x 50304 x 768) and a
// long weight-gradient sum over 16384 tokens.
TEST(Gemm16Tiles, ShapesWithinTheBudget) {
  using cpu::GemmTiles;
  GemmTiles small = GemmTiles::for_shape(37, 29, 48);
  EXPECT_EQ(small.m, 37);
  EXPECT_EQ(small.n, 29);
  EXPECT_EQ(small.k, 48);
  for (auto [M, N, K] : {std::array<int64_t, 3>{4096, 50304, 768}, {768, 3072, 16384}, {4096, 2304, 768}}) {
    GemmTiles t = GemmTiles::for_shape(M, N, K);
    SCOPED_TRACE(testing::Message() << M << " x " << N << " x " << K << ": tiles " << t.m << ", " << t.n << ", " << t.k);
    EXPECT_LE(t.m * t.k, GemmTiles::kBudget);
    EXPECT_LE(t.n * t.k, GemmTiles::kBudget);
    EXPECT_LE(t.m * t.n, 2 * GemmTiles::kBudget);
    EXPECT_GE(t.m, 64);
    EXPECT_GE(t.n, 256);
  }
  // GPT-2 small's QKV projection fits whole: one conversion of each operand.
  GemmTiles qkv = GemmTiles::for_shape(4096, 2304, 768);
  EXPECT_EQ(qkv.n, 2304);
  EXPECT_EQ(qkv.k, 768);
}

template <class S>
class Linear16Test : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, In = 48, Out = 29;
  KernelContext ctx;
  std::vector<S> x = cast_vec<S>(randn(N * In, 1041));
  std::vector<S> w = cast_vec<S>(randn(Out * In, 1042, 0.2));
  std::vector<S> b = cast_vec<S>(randn(Out, 1043));
  std::vector<S> dy = cast_vec<S>(randn(N * Out, 1044));
  LinearGrads reference() const { return ref_linear_backward(to_f64(dy), to_f64(x), to_f64(w), N, In, Out); }
};
TYPED_TEST_SUITE(Linear16Test, Storage16);

TYPED_TEST(Linear16Test, Forward) {
  using S = TypeParam;
  auto& f = *this;
  for (bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "bias" : "no bias");
    auto y = cast_vec<S>(randn(f.N * f.Out, 1045));
    linear_forward(f.ctx, view(y, {f.N, f.Out}), view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}),
                   with_bias ? view(f.b, {f.Out}) : Tensor{});
    Vec ref = ref_linear_forward(to_f64(f.x), to_f64(f.w), with_bias ? to_f64(f.b) : Vec{}, f.N, f.In, f.Out);
    expect_near(y, ref, tol16<S>(), "y");
    expect_mostly_rounded(y, ref, kMinRounded, "y");
  }
}

// 16-bit dx, dw and dbias: dx per mode, dw and dbias on random prior values,
// each rounded once (prior + gradient).
TYPED_TEST(Linear16Test, BackwardSameDtype) {
  using S = TypeParam;
  auto& f = *this;
  LinearGrads g = f.reference();
  for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate}) {
    SCOPED_TRACE(mode == GradMode::Overwrite ? "Overwrite" : "Accumulate");
    auto dx = cast_vec<S>(randn(f.N * f.In, 1046));
    auto dw = cast_vec<S>(randn(f.Out * f.In, 1047));
    auto db = cast_vec<S>(randn(f.Out, 1048));
    Vec dx0 = to_f64(dx), dw0 = to_f64(dw), db0 = to_f64(db);
    linear_backward(f.ctx, view(dx, {f.N, f.In}), view(dw, {f.Out, f.In}), view(db, {f.Out}), view(f.dy, {f.N, f.Out}),
                    view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), mode);
    Vec want_dx = mode == GradMode::Overwrite ? g.dx : plus(dx0, g.dx);
    expect_near(dx, want_dx, tol16<S>(), "dx");
    expect_mostly_rounded(dx, want_dx, kMinRounded, "dx");
    expect_near(dw, plus(dw0, g.dw), tol16<S>(), "dw");
    expect_mostly_rounded(dw, plus(dw0, g.dw), kMinRounded, "dw");
    expect_near(db, plus(db0, g.db), tol16<S>(), "dbias");
  }
}

// Mixed precision: dw and dbias in F32 beside 16-bit activations, over two
// calls (two microbatches). The products of exact 16-bit values are summed
// in float straight into dw, so the F32 tolerance applies; a path that
// rounded the gradient to 16 bits anywhere would be off by ~u = 4e-3 (bf16).
TYPED_TEST(Linear16Test, BackwardF32ParameterGradients) {
  using S = TypeParam;
  auto& f = *this;
  LinearGrads g = f.reference();
  auto dw = cast_vec<float>(randn(f.Out * f.In, 1049));
  auto db = cast_vec<float>(randn(f.Out, 1050));
  Vec want_dw = to_f64(dw), want_db = to_f64(db);
  for (int micro = 0; micro < 2; ++micro) {
    linear_backward(f.ctx, Tensor{}, view(dw, {f.Out, f.In}), view(db, {f.Out}), view(f.dy, {f.N, f.Out}),
                    view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), GradMode::Overwrite);
    want_dw = plus(want_dw, g.dw);
    want_db = plus(want_db, g.db);
  }
  expect_near(dw, want_dw, kTolF32, "f32 dw");
  expect_near(db, want_db, kTolF32, "f32 dbias");
  size_t representable = 0;
  for (float v : dw) representable += double(v) == (std::is_same_v<S, bf16> ? ref_round_bf16(v) : ref_round_f16(v));
  EXPECT_LT(representable, dw.size() / 10) << "dw looks rounded to 16 bits";
}

// ---------------------------------------------------------------- linear + GELU

template <class T>
class LinearGeluTest : public ::testing::Test {};
using AllStorage = ::testing::Types<float, double, bf16, f16>;
TYPED_TEST_SUITE(LinearGeluTest, AllStorage);

// The fused pair against linear_forward + gelu_forward and gelu_backward +
// linear_backward on the same inputs: bitwise equal in every dtype (the CPU
// runs the same two halves). dpre aliasing dy is covered too.
TYPED_TEST(LinearGeluTest, MatchesUnfusedBitwise) {
  using T = TypeParam;
  const int64_t N = 23, In = 40, Out = 52;
  KernelContext ctx;
  auto x = cast_vec<T>(randn(N * In, 1061));
  auto w = cast_vec<T>(randn(Out * In, 1062, 0.3));
  auto b = cast_vec<T>(randn(Out, 1063));
  auto dy = cast_vec<T>(randn(N * Out, 1064));
  auto y = cast_vec<T>(randn(N * Out, 1065)), pre = cast_vec<T>(randn(N * Out, 1066));
  auto y_ref = y, pre_ref = pre;
  linear_gelu_forward(ctx, view(y, {N, Out}), view(pre, {N, Out}), view(x, {N, In}), view(w, {Out, In}), view(b, {Out}));
  linear_forward(ctx, view(pre_ref, {N, Out}), view(x, {N, In}), view(w, {Out, In}), view(b, {Out}));
  gelu_forward(ctx, view(y_ref, {N, Out}), view(pre_ref, {N, Out}));
  EXPECT_EQ(bytes_of(pre), bytes_of(pre_ref)) << "pre";
  EXPECT_EQ(bytes_of(y), bytes_of(y_ref)) << "y";

  auto dx = cast_vec<T>(randn(N * In, 1067)), dw = cast_vec<T>(randn(Out * In, 1068)), db = cast_vec<T>(randn(Out, 1069));
  auto dx_ref = dx, dw_ref = dw, db_ref = db;
  auto dpre = dy;  // aliased: dpre overwrites dy
  linear_gelu_backward(ctx, view(dx, {N, In}), view(dw, {Out, In}), view(db, {Out}), view(dpre, {N, Out}),
                       view(dpre, {N, Out}), view(pre, {N, Out}), view(x, {N, In}), view(w, {Out, In}),
                       GradMode::Accumulate);
  auto dpre_ref = cast_vec<T>(randn(N * Out, 1070));
  gelu_backward(ctx, view(dpre_ref, {N, Out}), view(dy, {N, Out}), view(pre_ref, {N, Out}));
  linear_backward(ctx, view(dx_ref, {N, In}), view(dw_ref, {Out, In}), view(db_ref, {Out}), view(dpre_ref, {N, Out}),
                  view(x, {N, In}), view(w, {Out, In}), GradMode::Accumulate);
  EXPECT_EQ(bytes_of(dpre), bytes_of(dpre_ref)) << "dpre";
  EXPECT_EQ(bytes_of(dx), bytes_of(dx_ref)) << "dx";
  EXPECT_EQ(bytes_of(dw), bytes_of(dw_ref)) << "dw";
  EXPECT_EQ(bytes_of(db), bytes_of(db_ref)) << "dbias";
}

// And against the float64 reference: pre = x w^T + b, y = gelu(pre). For
// 16-bit, y is GELU of the stored (rounded) pre; |gelu'| <= 1.13, so y is
// within 1.13 u |pre| + u |y| of gelu(exact pre): 3u of the scale.
TYPED_TEST(LinearGeluTest, ForwardMatchesReference) {
  using T = TypeParam;
  const int64_t N = 19, In = 33, Out = 45;
  KernelContext ctx;
  auto x = cast_vec<T>(randn(N * In, 1071));
  auto w = cast_vec<T>(randn(Out * In, 1072, 0.3));
  auto b = cast_vec<T>(randn(Out, 1073));
  auto y = cast_vec<T>(randn(N * Out, 1074)), pre = cast_vec<T>(randn(N * Out, 1075));
  linear_gelu_forward(ctx, view(y, {N, Out}), view(pre, {N, Out}), view(x, {N, In}), view(w, {Out, In}), view(b, {Out}));
  Vec ref_pre = ref_linear_forward(to_f64(x), to_f64(w), to_f64(b), N, In, Out), ref_y(ref_pre.size());
  for (size_t i = 0; i < ref_y.size(); ++i) ref_y[i] = ref_gelu(ref_pre[i]);
  const double t = is_16bit_v<T> ? 3 * unit_roundoff<T>() : tol<T>(kTolF32);
  expect_near(pre, ref_pre, t, "pre");
  expect_near(y, ref_y, t, "y");
}

// ---------------------------------------------------------------- dtype rules

TEST(Linear16Errors, GradientDtypesFollowThePrecisionRules) {
  KernelContext ctx;
  const int64_t N = 4, In = 8, Out = 3;
  std::vector<bf16> x(N * In), w(Out * In), dy(N * Out), dx(N * In), dw16(Out * In);
  std::vector<f16> dw_f16(Out * In);
  std::vector<double> dw_f64(Out * In);
  std::vector<float> x32(N * In), w32(Out * In), dy32(N * Out), dx32(N * In);
  std::vector<bf16> dw_bf16_for_f32(Out * In);
  // bf16 activations: dw may be bf16 or f32, not f16 or f64.
  expect_error([&] {
    linear_backward(ctx, view(dx, {N, In}), view(dw_f16, {Out, In}), Tensor{}, view(dy, {N, Out}), view(x, {N, In}),
                    view(w, {Out, In}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"linear_backward", "dw", "f16"});
  expect_error([&] {
    linear_backward(ctx, view(dx, {N, In}), view(dw_f64, {Out, In}), Tensor{}, view(dy, {N, Out}), view(x, {N, In}),
                    view(w, {Out, In}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"linear_backward", "dw", "f64"});
  // f32 activations: a 16-bit gradient is not allowed.
  expect_error([&] {
    linear_backward(ctx, view(dx32, {N, In}), view(dw_bf16_for_f32, {Out, In}), Tensor{}, view(dy32, {N, Out}),
                    view(x32, {N, In}), view(w32, {Out, In}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"linear_backward", "dw", "bf16"});
  // Mixed activations are rejected, not reinterpreted.
  expect_error([&] {
    linear_forward(ctx, view(dy, {N, Out}), view(x32, {N, In}), view(w, {Out, In}), Tensor{});
  }, ErrorKind::Shape, {"linear_forward", "x"});
}

}  // namespace
}  // namespace xirang::test
