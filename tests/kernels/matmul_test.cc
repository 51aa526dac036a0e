// Tests for kernels/matmul.h: matmul (all transposes, alpha/beta), the
// linear layer and the fused linear + GELU pair, each against the float64
// reference in reference.h, in every storage type (f64, f32, bf16, f16;
// 16-bit activations may take F32 parameter gradients), and the tiling of
// the 16-bit CPU path (kernels/cpu/gemm_16bit.h).
//
// Tolerances, relative to max(1, max|ref|) (MatmulTol below):
// - f32: 1e-5. The products here are dot products of K <= 48 terms of
//   unit-scale values; the fp32 error (unit roundoff 6e-8, BLAS blocking and
//   FMA included) grows like sqrt(K) * 6e-8 * |terms|, about 1e-6 of the
//   result's scale. 1e-5 leaves a 10x margin while an indexing or transpose
//   bug shows as an O(1) error. K = 9000 gives ~6e-6, still inside.
// - f64: 1e-10, only the order of operations differs from the reference.
// - 16-bit: inputs are rounded to the type first and the reference is
//   computed from those exact values, so the only 16-bit error left is the
//   final rounding of each stored output: at most u |y| with u = 2^-8 (bf16)
//   or 2^-11 (f16), i.e. u of the scale; the float arithmetic in between is
//   ~1e-6 of the scale. The tolerance is 2u: a 2x margin over one rounding,
//   while an output rounded twice through a long 16-bit sum, or a tile
//   written to the wrong place, is off by many u. >= 97% of the elements
//   must equal the reference rounded once (90% for K = 9000, whose float sum
//   carries ~sqrt(K) 2^-24 of the scale).
// - F32 gradients beside 16-bit activations get no 16-bit rounding at all:
//   the f32 tolerance, and most of their elements must not be representable
//   in 16 bits.
// - linear + GELU against the reference: for 16-bit, y is GELU of the stored
//   (rounded) pre; |gelu'| <= 1.13, so y is within 1.13 u |pre| + u |y| of
//   gelu(exact pre): 3u of the scale.
#include <array>
#include <cmath>
#include <limits>

#include "kernels/cpu/gemm_16bit.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
struct MatmulTol {
  static constexpr double out = stored_tol<T>(kTolF32, 2);         // any output stored as T
  static constexpr double gelu_out = stored_tol<T>(kTolF32, 3);    // linear + GELU against the reference
  static constexpr double grad = tol<StatType<T>>(kTolF32);        // F32 gradients of 16-bit activations
  static constexpr double rounded = 0.97, long_k_rounded = 0.9;    // 16-bit: fraction rounded once
};

template <class T>
class MatmulTest : public ::testing::Test {};
TYPED_TEST_SUITE(MatmulTest, StorageTypes, StorageTypeNames);

// out = alpha op(a) op(b) + beta out over an M x N x K problem, with every
// operand rounded to T first, and out pre-filled with random values so
// beta's term is checked.
template <class T>
void check_matmul(int64_t M, int64_t N, int64_t K, bool ta, bool tb, double alpha, double beta, uint64_t seed,
                  double min_rounded) {
  SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " trans_a " << ta << " trans_b " << tb);
  KernelContext ctx;
  auto a = cast_vec<T>(randn(M * K, seed));
  auto b = cast_vec<T>(randn(K * N, seed + 1));
  auto out = cast_vec<T>(randn(M * N, seed + 2));
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
  expect_stored(out, ref, MatmulTol<T>::out, min_rounded, "matmul out");
}

// The four transpose combinations with alpha and beta both away from 1 and 0.
TYPED_TEST(MatmulTest, AllTransposesWithAlphaBeta) {
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      check_matmul<TypeParam>(37, 29, 48, ta, tb, 0.75, -0.625, 1001 + 3 * (2 * ta + tb), MatmulTol<TypeParam>::rounded);
}

// K = 9000 > 4096: the 16-bit path sums five K tiles of 2048 into float and
// rounds once at the end.
TYPED_TEST(MatmulTest, LongInnerDimension) {
  check_matmul<TypeParam>(5, 7, 9000, false, false, 1.0, 0.5, 1011, MatmulTol<TypeParam>::long_k_rounded);
  check_matmul<TypeParam>(5, 7, 9000, true, true, 1.0, 0.5, 1014, MatmulTol<TypeParam>::long_k_rounded);
}

// Default alpha = 1, beta = 0: the output's previous contents must not
// matter, even when they are NaN. Arena memory is reused between steps, so
// stale NaN in an output buffer is a real situation (BLAS does not read C
// when beta is 0).
TYPED_TEST(MatmulTest, BetaZeroIgnoresStaleOutput) {
  using T = TypeParam;
  const int64_t M = 13, N = 7, K = 19;
  KernelContext ctx;
  auto a = cast_vec<T>(randn(M * K, 31));
  auto b = cast_vec<T>(randn(K * N, 32));
  auto out = cast_vec<T>(Vec(M * N, std::numeric_limits<double>::quiet_NaN()));
  Vec ref(M * N, 0.0);
  ref_matmul(ref, to_f64(a), to_f64(b), M, N, K, false, false, 1.0, 0.0);
  matmul(ctx, view(out, {M, N}), view(a, {M, K}), view(b, {K, N}), false, false);
  expect_near(out, ref, MatmulTol<T>::out, "matmul out");
}

// ---------------------------------------------------------------- 16-bit tiling

template <class S>
class Gemm16Test : public ::testing::Test {};
using Storage16 = ::testing::Types<bf16, f16>;
TYPED_TEST_SUITE(Gemm16Test, Storage16, StorageTypeNames);

// The tiling itself, with tiles far smaller than the problem (3 rows, 4
// columns, 5 of K over 13 x 11 x 17, none dividing evenly) so that every
// path runs: several M, N and K tiles, partial edge tiles, transposed tile
// extraction, beta on a 16-bit output (loaded, scaled, rounded once), the
// bias broadcast, and an F32 output summed in place.
TYPED_TEST(Gemm16Test, SmallTilesCoverEveryPath) {
  using S = TypeParam;
  using Tol = MatmulTol<S>;
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
      expect_near(c16, want, Tol::out, "16-bit C with beta");
      expect_mostly_rounded(c16, want, Tol::rounded, "16-bit C with beta");
      // 16-bit output with the bias broadcast (beta 0: prior contents ignored).
      auto cb = cast_vec<S>(randn(M * N, 1041));
      Vec want_b(M * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) want_b[i * N + j] = prod[i * N + j] + as_double(bias[j]);
      cpu::gemm_16bit<S, S>(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, cb.data(), N, bias.data(), tiles);
      expect_near(cb, want_b, Tol::out, "16-bit C with bias");
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

// ---------------------------------------------------------------- linear

template <class T>
class LinearTest : public ::testing::Test {
 public:
  using Tol = MatmulTol<T>;
  static constexpr int64_t N = 37, In = 48, Out = 29;
  KernelContext ctx;
  std::vector<T> x = cast_vec<T>(randn(N * In, 41));
  std::vector<T> w = cast_vec<T>(randn(Out * In, 42, 0.2));
  std::vector<T> b = cast_vec<T>(randn(Out, 43));
  std::vector<T> dy = cast_vec<T>(randn(N * Out, 44));
  LinearGrads reference() const { return ref_linear_backward(to_f64(dy), to_f64(x), to_f64(w), N, In, Out); }
};
TYPED_TEST_SUITE(LinearTest, StorageTypes, StorageTypeNames);

TYPED_TEST(LinearTest, ForwardWithBias) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y = cast_vec<T>(randn(f.N * f.Out, 45));  // garbage that must be overwritten
  linear_forward(f.ctx, view(y, {f.N, f.Out}), view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), view(f.b, {f.Out}));
  expect_stored(y, ref_linear_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.In, f.Out), TestFixture::Tol::out,
                TestFixture::Tol::rounded, "y");
}

// An undefined bias means none: y = x W^T exactly.
TYPED_TEST(LinearTest, ForwardWithoutBias) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y = cast_vec<T>(randn(f.N * f.Out, 46));
  linear_forward(f.ctx, view(y, {f.N, f.Out}), view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), Tensor{});
  expect_stored(y, ref_linear_forward(to_f64(f.x), to_f64(f.w), {}, f.N, f.In, f.Out), TestFixture::Tol::out, TestFixture::Tol::rounded,
                "y");
}

// A 3-D activation (B, T, in) is flattened by the caller; check that a
// flat2d view of it goes through unchanged.
TYPED_TEST(LinearTest, ForwardOnFlattenedBatch) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> y = cast_vec<T>(randn(f.N * f.Out, 47));
  Tensor x3 = view(f.x, {1, f.N, f.In});
  linear_forward(f.ctx, view(y, {f.N, f.Out}), x3.flat2d(), view(f.w, {f.Out, f.In}), view(f.b, {f.Out}));
  expect_near(y, ref_linear_forward(to_f64(f.x), to_f64(f.w), to_f64(f.b), f.N, f.In, f.Out), TestFixture::Tol::out, "y");
}

// dx is the gradient alone (Overwrite) or added to its random previous
// contents (Accumulate); dw and dbias always accumulate onto theirs
// (gradients add over microbatches). In T, each rounded once.
template <class T>
void check_linear_backward(LinearTest<T>& f, GradMode mode, uint64_t seed) {
  LinearGrads g = f.reference();
  auto dx = cast_vec<T>(randn(f.N * f.In, seed));
  auto dw = cast_vec<T>(randn(f.Out * f.In, seed + 1));
  auto db = cast_vec<T>(randn(f.Out, seed + 2));
  Vec dx0 = to_f64(dx), dw0 = to_f64(dw), db0 = to_f64(db);
  linear_backward(f.ctx, view(dx, {f.N, f.In}), view(dw, {f.Out, f.In}), view(db, {f.Out}), view(f.dy, {f.N, f.Out}),
                  view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), mode);
  using Tol = MatmulTol<T>;
  expect_stored(dx, mode == GradMode::Overwrite ? g.dx : plus(dx0, g.dx), Tol::out, Tol::rounded, "dx");
  expect_stored(dw, plus(dw0, g.dw), Tol::out, Tol::rounded, "dw");
  expect_near(db, plus(db0, g.db), Tol::out, "dbias");
}

TYPED_TEST(LinearTest, BackwardOverwrite) { check_linear_backward<TypeParam>(*this, GradMode::Overwrite, 51); }
TYPED_TEST(LinearTest, BackwardAccumulate) { check_linear_backward<TypeParam>(*this, GradMode::Accumulate, 54); }

// The first layer needs no dx and a bias-free layer has no dbias: both
// undefined, and dw must still be right.
TYPED_TEST(LinearTest, BackwardWithoutDxAndBias) {
  using T = TypeParam;
  auto& f = *this;
  auto dw = cast_vec<T>(randn(f.Out * f.In, 57));
  Vec dw0 = to_f64(dw);
  linear_backward(f.ctx, Tensor{}, view(dw, {f.Out, f.In}), Tensor{}, view(f.dy, {f.N, f.Out}), view(f.x, {f.N, f.In}),
                  view(f.w, {f.Out, f.In}), GradMode::Overwrite);
  LinearGrads g = f.reference();
  expect_near(dw, plus(dw0, g.dw), TestFixture::Tol::out, "dw");
}

// Parameter gradients in the widest dtype the precision rules allow beside
// T (F32 beside 16-bit activations: mixed precision), over two calls (two
// microbatches). The products of exact inputs are summed in float straight
// into dw, so the f32 tolerance applies; a 16-bit path that rounded the
// gradient to 16 bits anywhere would be off by ~u = 4e-3 (bf16).
TYPED_TEST(LinearTest, BackwardWideParameterGradients) {
  using T = TypeParam;
  using G = StatType<T>;
  auto& f = *this;
  LinearGrads g = f.reference();
  auto dw = cast_vec<G>(randn(f.Out * f.In, 58));
  auto db = cast_vec<G>(randn(f.Out, 59));
  Vec want_dw = to_f64(dw), want_db = to_f64(db);
  for (int micro = 0; micro < 2; ++micro) {
    linear_backward(f.ctx, Tensor{}, view(dw, {f.Out, f.In}), view(db, {f.Out}), view(f.dy, {f.N, f.Out}),
                    view(f.x, {f.N, f.In}), view(f.w, {f.Out, f.In}), GradMode::Overwrite);
    want_dw = plus(want_dw, g.dw);
    want_db = plus(want_db, g.db);
  }
  expect_near(dw, want_dw, TestFixture::Tol::grad, "dw");
  expect_near(db, want_db, TestFixture::Tol::grad, "dbias");
  if constexpr (is_16bit_v<T>) {
    size_t representable = 0;
    for (float v : dw) representable += double(v) == (std::is_same_v<T, bf16> ? ref_round_bf16(v) : ref_round_f16(v));
    EXPECT_LT(representable, dw.size() / 10) << "dw looks rounded to 16 bits";
  }
}

// ---------------------------------------------------------------- linear + GELU

template <class T>
class LinearGeluTest : public ::testing::Test {};
TYPED_TEST_SUITE(LinearGeluTest, StorageTypes, StorageTypeNames);

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
  const double t = MatmulTol<T>::gelu_out;
  expect_near(pre, ref_pre, t, "pre");
  expect_near(y, ref_y, t, "y");
}

// ---------------------------------------------------------------- errors

TEST(LinearErrors, WrongInFeaturesNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 7), y(5 * 3);
  expect_error([&] { linear_forward(ctx, view(y, {5, 3}), view(x, {5, 8}), view(w, {3, 7}), Tensor{}); },
               ErrorKind::Shape, {"linear"});
}

TEST(LinearErrors, WrongOutputShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 8), y(5 * 4);
  expect_error([&] { linear_forward(ctx, view(y, {5, 4}), view(x, {5, 8}), view(w, {3, 8}), Tensor{}); },
               ErrorKind::Shape, {"linear"});
}

TEST(LinearErrors, WrongBiasShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 8), y(5 * 3), b(4);
  expect_error([&] { linear_forward(ctx, view(y, {5, 3}), view(x, {5, 8}), view(w, {3, 8}), view(b, {4})); },
               ErrorKind::Shape, {"linear"});
}

TEST(LinearErrors, BackwardWrongDwShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<float> x(5 * 8), w(3 * 8), dy(5 * 3), dx(5 * 8), dw(3 * 7);
  expect_error([&] {
    linear_backward(ctx, view(dx, {5, 8}), view(dw, {3, 7}), Tensor{}, view(dy, {5, 3}), view(x, {5, 8}),
                    view(w, {3, 8}), GradMode::Overwrite);
  }, ErrorKind::Shape, {"linear"});
}

TEST(MatmulErrors, InnerDimensionMismatchNamesTheOp) {
  KernelContext ctx;
  std::vector<float> a(4 * 5), b(6 * 3), out(4 * 3);
  expect_error([&] { matmul(ctx, view(out, {4, 3}), view(a, {4, 5}), view(b, {6, 3}), false, false); },
               ErrorKind::Shape, {"matmul"});
}

// The header says all three tensors share the dtype; mixing is an error, not
// a silent reinterpretation of the bytes.
TEST(MatmulErrors, MixedDtypesRejected) {
  KernelContext ctx;
  std::vector<float> a(4 * 5), out(4 * 3);
  std::vector<double> b(5 * 3);
  expect_error([&] { matmul(ctx, view(out, {4, 3}), view(a, {4, 5}), view(b, {5, 3}), false, false); },
               ErrorKind::Shape, {"matmul"});
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
