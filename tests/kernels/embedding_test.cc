// Tests for kernels/embedding.h (token plus position embedding, the
// vocabulary-shard lookup and positions from a row offset) against the
// float64 reference, in every storage type (f64, f32, bf16, f16; beside
// 16-bit activations the table gradients may be F32).
//
// Tolerances, relative to max(1, max|ref|) (EmbeddingTol below):
// - f32: 1e-6. The forward is one addition per element (one fp32 rounding,
//   6e-8 relative); the backward sums each table row's contributions in
//   double and rounds once (header), so even rows that collect ~70 unit
//   values (scale ~10) carry one fp32 rounding.
// - f64: 1e-10, only the order of operations differs from the reference.
// - 16-bit (u = 2^-8 bf16, 2^-11 f16; inputs rounded to the type first):
//   outputs are one float addition rounded once: 2u, >= 99% of them the
//   reference rounded once; 16-bit table gradients are (prior + sum in
//   double) rounded once: 2u, with >= 97% of the elements exactly rounded
//   even for rows that collect ~70 contributions (adding them one by one in
//   16 bits would not be); F32 table gradients keep the f32 tolerance.
// - The lookup alone is a copy: exact.
#include "kernels/embedding.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-6;

template <class T>
struct EmbeddingTol {
  static constexpr double out = stored_tol<T>(kTolF32, 2);    // any output or gradient stored as T
  static constexpr double grad = tol<StatType<T>>(kTolF32);   // F32 table gradients beside 16-bit
  static constexpr double out_rounded = 0.99, grad_rounded = 0.97;  // 16-bit: fraction rounded once
};

template <class T>
class EmbeddingTest : public ::testing::Test {
 protected:
  using Tol = EmbeddingTol<T>;
  // V = 11 for B * T = 26 tokens forces repeated tokens, so the backward's
  // accumulation into one wte row from several positions is exercised.
  // wpe has more rows (16) than T, as a model's max context does.
  static constexpr int64_t B = 2, T_ = 13, C = 48, V = 11, MaxT = 16;
  KernelContext ctx;
  std::vector<int32_t> tokens = rand_int(B * T_, 501, 0, int32_t(V));
  std::vector<T> wte = cast_vec<T>(randn(V * C, 502));
  std::vector<T> wpe = cast_vec<T>(randn(MaxT * C, 503));
  std::vector<T> dout = cast_vec<T>(randn(B * T_ * C, 504));
};
TYPED_TEST_SUITE(EmbeddingTest, StorageTypes, StorageTypeNames);

TYPED_TEST(EmbeddingTest, Forward) {
  using T = TypeParam;
  auto& f = *this;
  auto out = cast_vec<T>(randn(f.B * f.T_ * f.C, 505));
  embedding_forward(f.ctx, view(out, {f.B, f.T_, f.C}), view(f.tokens, {f.B, f.T_}), view(f.wte, {f.V, f.C}),
                    view(f.wpe, {f.MaxT, f.C}));
  expect_stored(out, ref_embedding_forward(f.tokens, to_f64(f.wte), to_f64(f.wpe), f.B, f.T_, f.C), TestFixture::Tol::out,
                TestFixture::Tol::out_rounded, "out");
  // The lookup alone is a copy: exact.
  const int64_t N = f.B * f.T_;
  auto rows = cast_vec<T>(randn(N * f.C, 506));
  embedding_lookup(f.ctx, view(rows, {N, f.C}), view(f.tokens, {N}), view(f.wte, {f.V, f.C}), 0, f.V);
  expect_near(rows, ref_embedding_lookup(f.tokens, to_f64(f.wte), 0, f.V, f.C), 0.0, "lookup");
}

// dwte and dwpe accumulate onto random prior contents; rows of dwpe past T
// and rows of dwte for unused tokens must keep their values.
TYPED_TEST(EmbeddingTest, BackwardAccumulates) {
  using T = TypeParam;
  auto& f = *this;
  f.tokens[3] = f.tokens[17] = f.tokens[20];  // at least one token repeated across both sequences
  auto dwte = cast_vec<T>(randn(f.V * f.C, 506));
  auto dwpe = cast_vec<T>(randn(f.MaxT * f.C, 507));
  Vec ref_wte = to_f64(dwte), ref_wpe = to_f64(dwpe);
  ref_embedding_backward(ref_wte, ref_wpe, to_f64(f.dout), f.tokens, f.B, f.T_, f.C);
  embedding_backward(f.ctx, view(dwte, {f.V, f.C}), view(dwpe, {f.MaxT, f.C}), view(f.dout, {f.B, f.T_, f.C}),
                     view(f.tokens, {f.B, f.T_}));
  expect_stored(dwte, ref_wte, TestFixture::Tol::out, TestFixture::Tol::grad_rounded, "dwte");
  expect_stored(dwpe, ref_wpe, TestFixture::Tol::out, TestFixture::Tol::grad_rounded, "dwpe");
}

// Many contributions per table row: 210 tokens over V = 5 ids (~42 per
// row, ~70 for the forced one); B = 3 sequences of T = 70, so each position
// collects 3 rows.
template <class T>
struct ManyRows {
  static constexpr int64_t B = 3, T_ = 70, N = B * T_, C = 37, V = 5, MaxT = 72;
  std::vector<int32_t> tokens = [] {
    auto t = rand_int(N, 1401, 0, int32_t(V));
    for (int64_t i = 0; i < N; i += 7) t[i] = 2;
    return t;
  }();
  std::vector<T> wpe = cast_vec<T>(randn(MaxT * C, 1403));
  std::vector<T> dout = cast_vec<T>(randn(N * C, 1404));
};

// Gradients of both tables in T and, beside 16-bit activations, in F32,
// accumulating onto prior values.
TYPED_TEST(EmbeddingTest, BackwardManyContributionsPerRow) {
  using T = TypeParam;
  using G = StatType<T>;
  auto& f = *this;
  ManyRows<T> m;
  Vec zero_wte(m.V * m.C, 0.0), zero_wpe(m.MaxT * m.C, 0.0);
  ref_embedding_backward(zero_wte, zero_wpe, to_f64(m.dout), m.tokens, m.B, m.T_, m.C);
  auto dwte = cast_vec<T>(randn(m.V * m.C, 1407));
  auto dwpe = cast_vec<T>(randn(m.MaxT * m.C, 1408));
  Vec want_te = plus(to_f64(dwte), zero_wte), want_pe = plus(to_f64(dwpe), zero_wpe);
  embedding_backward(f.ctx, view(dwte, {m.V, m.C}), view(dwpe, {m.MaxT, m.C}), view(m.dout, {m.B, m.T_, m.C}),
                     view(m.tokens, {m.B, m.T_}));
  expect_stored(dwte, want_te, TestFixture::Tol::out, TestFixture::Tol::grad_rounded, "dwte");
  expect_stored(dwpe, want_pe, TestFixture::Tol::out, TestFixture::Tol::grad_rounded, "dwpe");
  if constexpr (is_16bit_v<T>) {
    auto dwte32 = cast_vec<G>(randn(m.V * m.C, 1409));
    auto dwpe32 = cast_vec<G>(randn(m.MaxT * m.C, 1410));
    Vec want_te32 = plus(to_f64(dwte32), zero_wte), want_pe32 = plus(to_f64(dwpe32), zero_wpe);
    embedding_backward(f.ctx, view(dwte32, {m.V, m.C}), view(dwpe32, {m.MaxT, m.C}), view(m.dout, {m.B, m.T_, m.C}),
                       view(m.tokens, {m.B, m.T_}));
    expect_near(dwte32, want_te32, TestFixture::Tol::grad, "f32 dwte");
    expect_near(dwpe32, want_pe32, TestFixture::Tol::grad, "f32 dwpe");
  }
}

// Sharded lookup backward and positions from an offset (sequence
// parallelism): the shards' gradients (F32 beside 16-bit activations) are
// slices of the full one, bitwise, and positions over runs of rows match
// the reference.
TYPED_TEST(EmbeddingTest, ShardsAndRowRuns) {
  using T = TypeParam;
  using G = StatType<T>;
  auto& f = *this;
  ManyRows<T> m;
  auto full = cast_vec<G>(randn(m.V * m.C, 1411));
  auto prior = full;
  embedding_lookup_backward(f.ctx, view(full, {m.V, m.C}), view(m.dout, {m.N, m.C}), view(m.tokens, {m.N}), 0, m.V);
  for (auto [begin, rows] : {std::pair<int64_t, int64_t>{0, 2}, {2, 3}}) {
    std::vector<G> shard(prior.begin() + begin * m.C, prior.begin() + (begin + rows) * m.C);
    embedding_lookup_backward(f.ctx, view(shard, {rows, m.C}), view(m.dout, {m.N, m.C}), view(m.tokens, {m.N}), begin,
                              m.V);
    EXPECT_EQ(shard, std::vector<G>(full.begin() + begin * m.C, full.begin() + (begin + rows) * m.C))
        << "shard at " << begin;
  }
  // add_positions over rows [5, 5 + 31) of sequences of 13 against the reference.
  const int64_t n = 31, seq = 13, off = 5;
  auto x = cast_vec<T>(randn(n * m.C, 1412));
  Vec want = ref_add_positions(to_f64(x), to_f64(m.wpe), n, m.C, seq, off);
  add_positions(f.ctx, view(x, {n, m.C}), view(m.wpe, {m.MaxT, m.C}), seq, off);
  expect_near(x, want, TestFixture::Tol::out, "add_positions");
  auto dwpe = cast_vec<T>(randn(m.MaxT * m.C, 1413));
  Vec want_pe = to_f64(dwpe);
  Vec dx = to_f64(std::vector<T>(m.dout.begin(), m.dout.begin() + n * m.C));
  ref_add_positions_backward(want_pe, dx, n, m.C, seq, off);
  add_positions_backward(f.ctx, view(dwpe, {m.MaxT, m.C}), view(m.dout, {m.N, m.C}).slice(0, n), seq, off);
  expect_stored(dwpe, want_pe, TestFixture::Tol::out, TestFixture::Tol::grad_rounded, "add_positions_backward");
}

TEST(EmbeddingErrors, OutputWidthMismatchNamesTheOp) {
  KernelContext ctx;
  std::vector<int32_t> tokens(2 * 3, 1);
  std::vector<float> wte(5 * 8), wpe(4 * 8), out(2 * 3 * 7);
  expect_error([&] {
    embedding_forward(ctx, view(out, {2, 3, 7}), view(tokens, {2, 3}), view(wte, {5, 8}), view(wpe, {4, 8}));
  }, ErrorKind::Shape, {"embedding"});
}

// wpe must cover every position: T = 5 with only 4 position rows.
TEST(EmbeddingErrors, SequenceLongerThanPositionTable) {
  KernelContext ctx;
  std::vector<int32_t> tokens(2 * 5, 1);
  std::vector<float> wte(5 * 8), wpe(4 * 8), out(2 * 5 * 8);
  expect_error([&] {
    embedding_forward(ctx, view(out, {2, 5, 8}), view(tokens, {2, 5}), view(wte, {5, 8}), view(wpe, {4, 8}));
  }, ErrorKind::Shape, {"embedding"});
}

// A token id outside [0, V) would read another tensor's memory; it is a
// data error (a bad shard or tokenizer) naming the op and the position.
TEST(EmbeddingErrors, TokenOutsideVocabularyIsADataError) {
  KernelContext ctx;
  std::vector<int32_t> tokens = {1, 2, 5, 0};
  std::vector<float> wte(5 * 8), wpe(4 * 8), out(1 * 4 * 8);
  expect_error([&] {
    embedding_forward(ctx, view(out, {1, 4, 8}), view(tokens, {1, 4}), view(wte, {5, 8}), view(wpe, {4, 8}));
  }, ErrorKind::Data, {"embedding", "5"});
  std::vector<float> dwte(5 * 8), dwpe(4 * 8), dout(1 * 4 * 8);
  tokens[2] = -1;
  expect_error([&] {
    embedding_backward(ctx, view(dwte, {5, 8}), view(dwpe, {4, 8}), view(dout, {1, 4, 8}), view(tokens, {1, 4}));
  }, ErrorKind::Data, {"embedding", "-1"});
}

// The backward writes dwpe rows of width C; a dwpe of another width must be
// rejected, not written with the wrong stride. (Wider than needed here, so a
// missing check fails the test instead of corrupting memory.)
TEST(EmbeddingErrors, BackwardWrongDwpeShapeNamesTheOp) {
  KernelContext ctx;
  std::vector<int32_t> tokens = {1, 2, 3, 0};
  std::vector<float> dwte(5 * 8), dwpe(4 * 9), dout(1 * 4 * 8, 1.0f);
  expect_error([&] {
    embedding_backward(ctx, view(dwte, {5, 8}), view(dwpe, {4, 9}), view(dout, {1, 4, 8}), view(tokens, {1, 4}));
  }, ErrorKind::Shape, {"embedding", "dwpe"});
}

// Table gradients beside 16-bit activations are the same dtype or F32.
TEST(EmbeddingErrors, GradientDtypesBeside16BitActivations) {
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
