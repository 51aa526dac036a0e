// Tests for kernels/rope.h: the frequencies (Llama 3.1 scaling, with values
// derived by hand for the 8B config), the table, and the rotation of plain
// and packed q/k against a float64 reference written in Hugging Face's form
// (q * cos + rotate_half(q) * sin with cos, sin repeated over both halves),
// a finite-difference check of the backward, and the position rules the
// model relies on (batch rows, a key/value-cache offset, tensor-parallel
// head subsets).
//
// Tolerances, as max |got - ref| <= tol * max(1, max |ref|):
// - F32: 1e-6. An output is x1 c - x2 s formed in float from a table rounded
//   once to float: about 3 roundings of the inputs' size (|x| <= ~4 here, so
//   ~1e-6 of the unit scale at worst, usually far less). A wrong sign, pair
//   or position is off by O(1).
// - F64: 1e-10 (the table is the same double cos and sin; only the order
//   of the two products differs).
// - BF16/F16: 2u of the scale, and >= 97% of the elements equal to the
//   reference rounded once (the rotation is one float expression per output).
// - The F32 table: each entry is the double value rounded once, |err| <=
//   2^-24; the F64 table equals cos(p f) and sin(p f) to 1e-13 absolute.
#include <cmath>
#include <numbers>

#include "kernels/rope.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-6;
constexpr double kMinRounded = 0.97;

// ---------------------------------------------------------------- references

// Meta's apply_scaling (llama/model.py, Llama 3.1) over the plain
// frequencies 1 / theta^(2i/D).
Vec ref_frequencies(double theta, int64_t D, const RopeScaling& s) {
  Vec f(D / 2);
  for (int64_t i = 0; i < D / 2; ++i) {
    const double freq = 1.0 / std::pow(theta, double(2 * i) / double(D));
    f[i] = freq;
    if (s.type != RopeScaling::Type::Llama3) continue;
    const double low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    const double high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    const double wavelen = 2 * std::numbers::pi / freq;
    if (wavelen < high_freq_wavelen) {
      f[i] = freq;
    } else if (wavelen > low_freq_wavelen) {
      f[i] = freq / s.factor;
    } else {
      const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      f[i] = (1 - smooth) * freq / s.factor + smooth * freq;
    }
  }
  return f;
}

// rows of `width`; heads [0, rot_heads) of D elements rotated at position
// pos_offset + r % seq_len, by +angle (sign 1) or -angle (sign -1):
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1].
Vec ref_rope(const Vec& x, int64_t rows, int64_t width, int64_t rot_heads, int64_t D, int64_t seq_len,
             int64_t pos_offset, const Vec& freq, int sign = 1) {
  Vec out = x;
  Vec c(D), s(D), rh(D);
  for (int64_t r = 0; r < rows; ++r) {
    const double p = double(pos_offset + r % seq_len);
    for (int64_t j = 0; j < D; ++j) {
      c[j] = std::cos(p * freq[j % (D / 2)]);
      s[j] = sign * std::sin(p * freq[j % (D / 2)]);
    }
    for (int64_t h = 0; h < rot_heads; ++h) {
      const double* q = &x[r * width + h * D];
      for (int64_t j = 0; j < D; ++j) rh[j] = j < D / 2 ? -q[j + D / 2] : q[j - D / 2];
      for (int64_t j = 0; j < D; ++j) out[r * width + h * D + j] = q[j] * c[j] + rh[j] * s[j];
    }
  }
  return out;
}

const RopeConfig kLlama31{500000.0, RopeScaling::llama3(8.0, 1.0, 4.0, 8192.0)};

template <class S>
using table_t = std::conditional_t<is_16bit_v<S>, float, S>;

template <class S>
double tolerance() {
  if constexpr (is_16bit_v<S>) return 2 * unit_roundoff<S>();
  else return tol<S>(kTolF32);
}

// The table for T_max positions of head dim D, in the dtype the op takes beside S.
template <class S>
struct Table {
  int64_t T_max, half;
  std::vector<table_t<S>> cos, sin;
  Table(const RopeConfig& cfg, int64_t T_max_, int64_t D)
      : T_max(T_max_), half(D / 2), cos(T_max_ * (D / 2)), sin(T_max_ * (D / 2)) {
    rope_table(KernelContext{}, view(cos, {T_max, half}), view(sin, {T_max, half}), cfg);
  }
  Tensor c() { return view(cos, {T_max, half}); }
  Tensor s() { return view(sin, {T_max, half}); }
};

// ---------------------------------------------------------------- frequencies

// No scaling: freq_i = theta^(-2i/D). For theta 10000 and D 64,
// freq_16 = 10000^(-1/2) = 0.01 and freq_31 = 10000^(-31/32).
TEST(RopeFrequencies, Plain) {
  RopeConfig cfg{10000.0, {}};
  Vec f = rope_frequencies(cfg, 64);
  ASSERT_EQ(f.size(), 32u);
  EXPECT_EQ(f[0], 1.0);
  EXPECT_NEAR(f[16], 0.01, 1e-17);
  EXPECT_NEAR(f[31] / std::pow(10000.0, -31.0 / 32.0), 1.0, 1e-15);
  expect_near(f, ref_frequencies(10000.0, 64, {}), 1e-15, "plain frequencies");
}

// Llama 3.1 8B: theta 500000, D 128, factor 8, low 1, high 4, original
// 8192. Plain freq_i = 500000^(-i/64), wavelength 2 pi 500000^(i/64).
// Kept: wavelength < 8192 / 4 = 2048, i.e. 500000^(i/64) < 2048 / 2 pi =
// 325.95, i < 64 ln(325.95) / ln(500000) = 28.2: i <= 28. Divided by 8:
// wavelength > 8192 / 1, 500000^(i/64) > 1303.8, i > 34.98: i >= 35.
// Interpolated: i = 29..34. By hand for i = 32: freq = 500000^(-1/2) =
// 1 / 707.1068 = 1.4142136e-3, wavelength = 2 pi 707.1068 = 4442.883,
// s = (8192 / 4442.883 - 1) / (4 - 1) = 0.2812816, and the scaled
// frequency is freq ((1 - s) / 8 + s) = freq * 0.3711223 = 5.2484616e-4.
// Likewise i = 29 (wavelength 2401.738): ratio 0.8281684; i = 34
// (wavelength 6695.109): ratio 0.1902107.
TEST(RopeFrequencies, Llama31ScalingOfThe8BConfig) {
  const Vec f = rope_frequencies(kLlama31, 128);
  const Vec plain = rope_frequencies({500000.0, {}}, 128);
  ASSERT_EQ(f.size(), 64u);
  for (int i = 0; i <= 28; ++i) EXPECT_EQ(f[i], plain[i]) << "kept: i = " << i;
  for (int i = 35; i < 64; ++i) EXPECT_NEAR(f[i] / plain[i], 0.125, 1e-15) << "divided by 8: i = " << i;
  for (int i = 29; i <= 34; ++i) {
    EXPECT_GT(f[i], plain[i] / 8) << "interpolated: i = " << i;
    EXPECT_LT(f[i], plain[i]) << "interpolated: i = " << i;
  }
  EXPECT_EQ(f[0], 1.0);
  EXPECT_NEAR(plain[32], 1.4142136e-3, 1e-10);
  EXPECT_NEAR(f[32], 5.2484616e-4, 1e-11);
  EXPECT_NEAR(f[32] / plain[32], 0.3711223, 1e-7);
  EXPECT_NEAR(f[29] / plain[29], 0.8281684, 1e-7);
  EXPECT_NEAR(f[34] / plain[34], 0.1902107, 1e-7);
  // The same closed form for i = 32, evaluated here.
  const double f32 = 1.0 / std::sqrt(500000.0);
  const double s = (8192.0 / (2 * std::numbers::pi / f32) - 1.0) / 3.0;
  EXPECT_NEAR(f[32], f32 * ((1 - s) / 8 + s), 1e-18);
  expect_near(f, ref_frequencies(500000.0, 128, kLlama31.scaling), 1e-15, "8B frequencies");
}

// A small config whose band edges fall inside a D = 16 head (theta 10000,
// wavelengths 2 pi 10000^(i/8) = 6.3, 19.9, 62.8, 198.7, 628.3, ... for
// i = 0, 1, ...; original 512, factor 4, low 1, high 16: kept below 32
// (i <= 1), divided above 512 (i >= 4), interpolated for i = 2, 3), as the
// model tests will use.
TEST(RopeFrequencies, SmallConfigHasEveryBand) {
  const RopeConfig cfg{10000.0, RopeScaling::llama3(4.0, 1.0, 16.0, 512.0)};
  const Vec f = rope_frequencies(cfg, 16), plain = rope_frequencies({10000.0, {}}, 16);
  expect_near(f, ref_frequencies(10000.0, 16, cfg.scaling), 1e-15, "frequencies");
  EXPECT_EQ(f[1], plain[1]);
  EXPECT_NEAR(f[4] / plain[4], 0.25, 1e-15);
  for (int i : {2, 3}) EXPECT_TRUE(f[i] > plain[i] / 4 && f[i] < plain[i]) << i;
}

TEST(RopeFrequencies, BadConfigsNameTheKey) {
  expect_error([] { rope_frequencies({10000.0, {}}, 63); }, ErrorKind::Config, {"head_dim"});
  expect_error([] { rope_frequencies({1.0, {}}, 64); }, ErrorKind::Config, {"rope_theta"});
  expect_error([] { rope_frequencies({10000.0, RopeScaling::llama3(0.0, 1, 4, 8192)}, 64); }, ErrorKind::Config,
               {"factor"});
  expect_error([] { rope_frequencies({10000.0, RopeScaling::llama3(8.0, 4, 1, 8192)}, 64); }, ErrorKind::Config,
               {"low_freq_factor"});
  expect_error([] { rope_frequencies({10000.0, RopeScaling::llama3(8.0, 1, 4, 0)}, 64); }, ErrorKind::Config,
               {"original_max_position_embeddings"});
}

// ---------------------------------------------------------------- table

TEST(RopeTable, F64AndF32) {
  const int64_t T_max = 300, D = 16;
  const Vec f = ref_frequencies(kLlama31.theta, D, kLlama31.scaling);
  Vec want_c(T_max * D / 2), want_s(T_max * D / 2);
  for (int64_t p = 0; p < T_max; ++p)
    for (int64_t i = 0; i < D / 2; ++i) {
      want_c[p * D / 2 + i] = std::cos(double(p) * f[i]);
      want_s[p * D / 2 + i] = std::sin(double(p) * f[i]);
    }
  Table<double> t64(kLlama31, T_max, D);
  expect_near(t64.cos, want_c, 1e-13, "f64 cos");
  expect_near(t64.sin, want_s, 1e-13, "f64 sin");
  Table<float> t32(kLlama31, T_max, D);
  expect_near(t32.cos, want_c, 0x1p-24, "f32 cos");
  expect_near(t32.sin, want_s, 0x1p-24, "f32 sin");
}

// ---------------------------------------------------------------- rotation

template <class S>
class RopeTest : public ::testing::Test {
 protected:
  static constexpr int64_t B = 3, T = 7, H = 4, KV = 2, D = 16, T_max = 40;
  KernelContext ctx;
  Table<S> table{kLlama31, T_max, D};
  const Vec freq = ref_frequencies(kLlama31.theta, D, kLlama31.scaling);
};
using AllStorage = ::testing::Types<float, double, bf16, f16>;
TYPED_TEST_SUITE(RopeTest, AllStorage);

// Every head of (B, T, H*D) rows, from position 0 and from an offset (a
// key/value cache of 11 tokens): row b*T + t at position offset + t.
TYPED_TEST(RopeTest, ForwardMatchesReference) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t W = f.H * f.D;
  for (int64_t offset : {int64_t(0), int64_t(11)}) {
    SCOPED_TRACE(offset);
    auto x = cast_vec<S>(randn(f.B * f.T * W, 3101, 1.5));
    Vec want = ref_rope(to_f64(x), f.B * f.T, W, f.H, f.D, f.T, offset, f.freq);
    rope_forward(f.ctx, view(x, {f.B, f.T, W}), f.table.c(), f.table.s(), f.T, offset);
    expect_near(x, want, tolerance<S>(), "rotated x");
    if constexpr (is_16bit_v<S>) expect_mostly_rounded(x, want, kMinRounded, "rotated x");
  }
}

// The packed row [q (H heads) | k (KV heads) | v (KV heads)]: q and k
// rotated as the reference, v untouched, and q and k bitwise equal to
// rope_forward on them alone.
TYPED_TEST(RopeTest, PackedQkv) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t N = f.B * f.T, W = (f.H + 2 * f.KV) * f.D, Wq = f.H * f.D, Wk = f.KV * f.D;
  const Vec x0 = to_f64(cast_vec<S>(randn(N * W, 3111, 1.5)));
  auto qkv = cast_vec<S>(x0);
  rope_qkv_forward(f.ctx, view(qkv, {f.B, f.T, W}), f.table.c(), f.table.s(), int(f.H), int(f.KV), f.T, 5);
  Vec want = ref_rope(x0, N, W, f.H + f.KV, f.D, f.T, 5, f.freq);
  expect_near(qkv, want, tolerance<S>(), "rotated qkv");
  std::vector<S> q(N * Wq), k(N * Wk);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < W; ++j) {
      const S orig = cast_vec<S>({x0[r * W + j]})[0];
      if (j < Wq) q[r * Wq + j] = orig;
      else if (j < Wq + Wk) k[r * Wk + j - Wq] = orig;
      else EXPECT_EQ(bytes_of(std::vector<S>{qkv[r * W + j]}), bytes_of(std::vector<S>{orig})) << "v changed at " << r << ", " << j;
    }
  rope_forward(f.ctx, view(q, {N, Wq}), f.table.c(), f.table.s(), f.T, 5);
  rope_forward(f.ctx, view(k, {N, Wk}), f.table.c(), f.table.s(), f.T, 5);
  for (int64_t r = 0; r < N; ++r) {
    std::vector<S> got_q(qkv.begin() + r * W, qkv.begin() + r * W + Wq);
    std::vector<S> got_k(qkv.begin() + r * W + Wq, qkv.begin() + r * W + Wq + Wk);
    std::vector<S> want_q(q.begin() + r * Wq, q.begin() + (r + 1) * Wq);
    std::vector<S> want_k(k.begin() + r * Wk, k.begin() + (r + 1) * Wk);
    ASSERT_EQ(bytes_of(got_q), bytes_of(want_q)) << "q of row " << r;
    ASSERT_EQ(bytes_of(got_k), bytes_of(want_k)) << "k of row " << r;
  }
}

// Tensor parallelism: rank 1 of 2 holds q heads [2, 4) and kv head [1, 2)
// of every token, packed as its own (B, T, (2 + 2) D) row. Its rotation is
// bitwise the same heads of the whole rotation: positions depend on the row.
TYPED_TEST(RopeTest, TensorParallelHeadSubset) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t N = f.B * f.T, D = f.D, W = (f.H + 2 * f.KV) * D, Wr = (f.H / 2 + 2 * (f.KV / 2)) * D;
  auto full = cast_vec<S>(randn(N * W, 3121));
  std::vector<S> rank(N * Wr);
  // Rank 1's column blocks of the q, k and v parts.
  auto copy_block = [&](std::vector<S>& dst, int64_t dst_col, int64_t src_col, int64_t n) {
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < n; ++j) dst[r * Wr + dst_col + j] = full[r * W + src_col + j];
  };
  copy_block(rank, 0, 2 * D, 2 * D);                      // q heads 2, 3
  copy_block(rank, 2 * D, f.H * D + D, D);                // k head 1
  copy_block(rank, 3 * D, (f.H + f.KV) * D + D, D);       // v head 1
  rope_qkv_forward(f.ctx, view(full, {N, W}), f.table.c(), f.table.s(), int(f.H), int(f.KV), f.T, 0);
  rope_qkv_forward(f.ctx, view(rank, {N, Wr}), f.table.c(), f.table.s(), int(f.H / 2), int(f.KV / 2), f.T, 0);
  for (int64_t r = 0; r < N; ++r)
    for (auto [dst, src, n] : {std::tuple{int64_t(0), 2 * D, 2 * D}, std::tuple{2 * D, f.H * D + D, D},
                               std::tuple{3 * D, (f.H + f.KV) * D + D, D}})
      for (int64_t j = 0; j < n; ++j)
        ASSERT_EQ(as_double(rank[r * Wr + dst + j]), as_double(full[r * W + src + j])) << "row " << r << " col " << dst + j;
}

// Generation: one new token per sequence at position p (seq_len 1,
// pos_offset p) rotates exactly as row p of the whole sequence.
TYPED_TEST(RopeTest, CacheOffsetMatchesFullSequence) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t W = f.H * f.D;
  auto x = cast_vec<S>(randn(f.T * W, 3131));
  auto full = x;
  rope_forward(f.ctx, view(full, {1, f.T, W}), f.table.c(), f.table.s(), f.T, 0);
  for (int64_t p = 0; p < f.T; ++p) {
    std::vector<S> one(x.begin() + p * W, x.begin() + (p + 1) * W);
    rope_forward(f.ctx, view(one, {1, 1, W}), f.table.c(), f.table.s(), 1, p);
    std::vector<S> want(full.begin() + p * W, full.begin() + (p + 1) * W);
    ASSERT_EQ(bytes_of(one), bytes_of(want)) << "position " << p;
  }
}

// Backward is the rotation by -angle: against the reference with sign -1,
// for both forms, and it undoes the forward (to the rounding of two passes).
TYPED_TEST(RopeTest, Backward) {
  using S = TypeParam;
  auto& f = *this;
  const int64_t N = f.B * f.T, W = (f.H + 2 * f.KV) * f.D;
  const Vec d0 = to_f64(cast_vec<S>(randn(N * W, 3141)));
  auto dqkv = cast_vec<S>(d0);
  rope_qkv_backward(f.ctx, view(dqkv, {N, W}), f.table.c(), f.table.s(), int(f.H), int(f.KV), f.T, 3);
  expect_near(dqkv, ref_rope(d0, N, W, f.H + f.KV, f.D, f.T, 3, f.freq, -1), tolerance<S>(), "dqkv");
  auto dx = cast_vec<S>(d0);
  rope_backward(f.ctx, view(dx, {N, W}), f.table.c(), f.table.s(), f.T, 3);
  expect_near(dx, ref_rope(d0, N, W, W / f.D, f.D, f.T, 3, f.freq, -1), tolerance<S>(), "dx");
  rope_forward(f.ctx, view(dx, {N, W}), f.table.c(), f.table.s(), f.T, 3);
  expect_near(dx, d0, 2 * tolerance<S>(), "forward(backward(d))");
}

// Central differences on L = sum(rope(x) * R) in float64 against
// rope_backward(R), packed and plain, with Llama 3.1 frequencies and a
// cache offset.
TEST(RopeGradCheck, FiniteDifferences) {
  const int64_t B = 2, T = 3, H = 2, KV = 1, D = 8, W = (H + 2 * KV) * D;
  const double h = 1e-6;
  KernelContext ctx;
  Table<double> table(kLlama31, 16, D);
  Vec x = randn(B * T * W, 3151), R = randn(B * T * W, 3152);
  for (bool packed : {true, false}) {
    SCOPED_TRACE(packed ? "packed" : "plain");
    auto loss = [&]() {
      Vec y = x;
      if (packed) rope_qkv_forward(ctx, view(y, {B, T, W}), table.c(), table.s(), int(H), int(KV), T, 4);
      else rope_forward(ctx, view(y, {B, T, W}), table.c(), table.s(), T, 4);
      double L = 0;
      for (size_t i = 0; i < y.size(); ++i) L += y[i] * R[i];
      return L;
    };
    Vec dx = R;
    if (packed) rope_qkv_backward(ctx, view(dx, {B, T, W}), table.c(), table.s(), int(H), int(KV), T, 4);
    else rope_backward(ctx, view(dx, {B, T, W}), table.c(), table.s(), T, 4);
    EXPECT_LT(normwise_error(numeric_gradient(x, h, loss), dx), 1e-6);
  }
}

TEST(RopeErrors, ShapesPositionsAndDtypes) {
  KernelContext ctx;
  const int64_t T_max = 8, D = 8;
  Table<float> table({10000.0, {}}, T_max, D);
  std::vector<float> x(2 * 4 * 3 * D, 1.0f);
  // Positions past the table.
  expect_error([&] { rope_forward(ctx, view(x, {2, 4, 3 * D}), table.c(), table.s(), 4, 5); }, ErrorKind::Shape,
               {"rope_forward", "positions"});
  // Rows that are not whole sequences.
  expect_error([&] { rope_forward(ctx, view(x, {8, 3 * D}), table.c(), table.s(), 3, 0); }, ErrorKind::Shape,
               {"rope_forward", "seq_len"});
  // Rows that are not whole heads.
  expect_error([&] { rope_forward(ctx, view(x, {16, 12}), table.c(), table.s(), 4, 0); }, ErrorKind::Shape,
               {"rope_forward", "heads"});
  // A packed row of 3 heads is not (2 + 2 * 1) heads.
  expect_error([&] { rope_qkv_forward(ctx, view(x, {2, 4, 3 * D}), table.c(), table.s(), 2, 1, 4, 0); },
               ErrorKind::Shape, {"rope_qkv_forward", "n_kv_head"});
  // bf16 activations take an F32 table.
  std::vector<bf16> x16(4 * D);
  std::vector<bf16> c16(T_max * D / 2), s16(T_max * D / 2);
  expect_error([&] { rope_forward(ctx, view(x16, {4, D}), view(c16, {T_max, D / 2}), view(s16, {T_max, D / 2}), 4, 0); },
               ErrorKind::Shape, {"rope_forward", "cos", "f32"});
  expect_error([&] { rope_table(ctx, view(c16, {T_max, D / 2}), view(s16, {T_max, D / 2}), {10000.0, {}}); },
               ErrorKind::Shape, {"rope_table", "cos"});
}

// Under metrics.op_profile every call counts once as an elementwise op.
TEST(RopeProfile, CountsAsElementwise) {
  Timeline tl;
  tl.set_profiling(true);
  KernelContext ctx;
  ctx.timeline = &tl;
  const int64_t T = 4, D = 8;
  std::vector<float> c(T * D / 2), s(T * D / 2), x = cast_vec<float>(randn(T * 4 * D, 3161));
  rope_table(ctx, view(c, {T, D / 2}), view(s, {T, D / 2}), kLlama31);
  rope_forward(ctx, view(x, {T, 4 * D}), view(c, {T, D / 2}), view(s, {T, D / 2}), T, 0);
  rope_backward(ctx, view(x, {T, 4 * D}), view(c, {T, D / 2}), view(s, {T, D / 2}), T, 0);
  rope_qkv_forward(ctx, view(x, {T, 4 * D}), view(c, {T, D / 2}), view(s, {T, D / 2}), 2, 1, T, 0);
  rope_qkv_backward(ctx, view(x, {T, 4 * D}), view(c, {T, D / 2}), view(s, {T, D / 2}), 2, 1, T, 0);
  EXPECT_EQ(tl.take_ops().calls[int(OpKind::Elementwise)], 5);
}

}  // namespace
}  // namespace xirang::test
