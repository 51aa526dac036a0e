// Tests for kernels/embedding.h (token plus position embedding) against the
// float64 reference.
//
// The forward is one addition per element (one fp32 rounding, 6e-8 relative);
// the backward adds at most B * T = 26 rows into one table row. 1e-6 of
// max(1, max|ref|) covers both with margin.
#include "kernels/embedding.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-6;

template <class T>
class EmbeddingTest : public ::testing::Test {
 protected:
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
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(EmbeddingTest, ComputeTypes);

TYPED_TEST(EmbeddingTest, Forward) {
  using T = TypeParam;
  auto& f = *this;
  auto out = cast_vec<T>(randn(f.B * f.T_ * f.C, 505));
  embedding_forward(f.ctx, view(out, {f.B, f.T_, f.C}), view(f.tokens, {f.B, f.T_}), view(f.wte, {f.V, f.C}),
                    view(f.wpe, {f.MaxT, f.C}));
  expect_near(out, ref_embedding_forward(f.tokens, to_f64(f.wte), to_f64(f.wpe), f.B, f.T_, f.C), tol<T>(kTolF32),
              "out");
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
  expect_near(dwte, ref_wte, tol<T>(kTolF32), "dwte");
  expect_near(dwpe, ref_wpe, tol<T>(kTolF32), "dwpe");
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

}  // namespace
}  // namespace xirang::test
