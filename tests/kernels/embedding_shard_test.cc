// Tests for the pieces of kernels/embedding.h that tensor and sequence
// parallelism compose: embedding_lookup over vocabulary shards (and its
// backward), add_positions over a run of rows that may start mid-sequence
// (and its backward).
//
// Tolerances: a lookup is a copy, and a token's row is non-zero on exactly
// one shard, so the shards' outputs sum to the full lookup exactly; a shard's
// backward does the full backward's additions for its rows in the same order,
// so it matches the full one bitwise. Against the float64 reference, the
// forward of add_positions is one fp32 addition (6e-8 relative) and the
// backwards add at most 26 rows into one table row; 1e-6 of max(1, max|ref|)
// covers both, as in embedding_test.cc.
#include <omp.h>

#include "kernels/embedding.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-6;

// A vocabulary split: shard s holds rows [begin[s], begin[s] + rows[s]).
struct Split {
  std::vector<int64_t> begin, rows;
};

// tp equal shards of Vp rows, and one uneven split.
std::vector<Split> splits(int64_t Vp) {
  std::vector<Split> out;
  for (int64_t tp : {1, 2, 3, 4}) {
    Split s;
    for (int64_t k = 0; k < tp; ++k) s.begin.push_back(k * Vp / tp), s.rows.push_back(Vp / tp);
    out.push_back(s);
  }
  out.push_back(Split{{0, 5}, {5, Vp - 5}});
  return out;
}

template <class T>
class EmbeddingShardTest : public ::testing::Test {
 protected:
  // V = 11 real rows padded to Vp = 12 (the last shard of each split holds
  // the padding row). N = 26 tokens over 11 ids forces repeats, so the
  // backward accumulates several rows into one table row.
  static constexpr int64_t N = 26, C = 48, V = 11, Vp = 12;
  KernelContext ctx;
  std::vector<int32_t> tokens = [] {
    auto t = rand_int(N, 701, 0, int32_t(V));
    t[3] = t[17] = t[20];
    t[0] = 0, t[N - 1] = int32_t(V - 1);
    return t;
  }();
  std::vector<T> wte = cast_vec<T>(randn(Vp * C, 702));
  std::vector<T> dout = cast_vec<T>(randn(N * C, 703));

  std::vector<T> rows_of(const std::vector<T>& table, int64_t begin, int64_t rows) const {
    return std::vector<T>(table.begin() + begin * C, table.begin() + (begin + rows) * C);
  }
};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(EmbeddingShardTest, ComputeTypes);

// Every split: each shard's output against the reference (zero rows for the
// other shards' tokens, written over random prior contents), and their sum
// against the full lookup, exactly.
TYPED_TEST(EmbeddingShardTest, LookupShardsSumToFull) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, C = f.C;
  auto full = cast_vec<T>(randn(N * C, 704));
  embedding_lookup(f.ctx, view(full, {N, C}), view(f.tokens, {N}), view(f.wte, {f.Vp, C}), 0, f.V);
  expect_near(full, ref_embedding_lookup(f.tokens, to_f64(f.wte), 0, f.Vp, C), 0.0, "full lookup");
  for (const Split& sp : splits(f.Vp)) {
    std::vector<T> sum(N * C, T(0));
    for (size_t s = 0; s < sp.begin.size(); ++s) {
      auto shard = f.rows_of(f.wte, sp.begin[s], sp.rows[s]);
      auto out = cast_vec<T>(randn(N * C, 705 + s));
      embedding_lookup(f.ctx, view(out, {N, C}), view(f.tokens, {N}), view(shard, {sp.rows[s], C}), sp.begin[s], f.V);
      std::string what = "shard at " + std::to_string(sp.begin[s]) + " of " + std::to_string(sp.rows[s]) + " rows";
      expect_near(out, ref_embedding_lookup(f.tokens, to_f64(shard), sp.begin[s], sp.rows[s], C), 0.0, what);
      for (int64_t k = 0; k < N * C; ++k) sum[k] += out[k];
    }
    ASSERT_EQ(sum, full) << "sum over " << sp.begin.size() << " shards";
  }
}

// The full backward against the reference (accumulating onto random prior
// contents), then each shard's backward against the slice of the full one.
TYPED_TEST(EmbeddingShardTest, LookupBackwardShardsAreSlicesOfFull) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, C = f.C;
  const auto prior = cast_vec<T>(randn(f.Vp * C, 710));
  auto full = prior;
  embedding_lookup_backward(f.ctx, view(full, {f.Vp, C}), view(f.dout, {N, C}), view(f.tokens, {N}), 0, f.V);
  Vec ref = to_f64(prior), unused_dwpe(N * C, 0.0);
  ref_embedding_backward(ref, unused_dwpe, to_f64(f.dout), f.tokens, 1, N, C);
  expect_near(full, ref, tol<T>(kTolF32), "full dwte");
  for (const Split& sp : splits(f.Vp)) {
    for (size_t s = 0; s < sp.begin.size(); ++s) {
      auto shard = f.rows_of(prior, sp.begin[s], sp.rows[s]);
      embedding_lookup_backward(f.ctx, view(shard, {sp.rows[s], C}), view(f.dout, {N, C}), view(f.tokens, {N}),
                                sp.begin[s], f.V);
      ASSERT_EQ(shard, f.rows_of(full, sp.begin[s], sp.rows[s]))
          << "dwte shard at " << sp.begin[s] << " of " << sp.rows[s] << " rows";
    }
  }
}

// The backward sums repeated tokens in row order whatever the thread count.
TYPED_TEST(EmbeddingShardTest, BackwardIsIndependentOfThreadCount) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, C = f.C;
  const int saved = omp_get_max_threads();
  std::vector<std::vector<T>> dwte, dwpe;
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    dwte.push_back(cast_vec<T>(randn(f.Vp * C, 711)));
    dwpe.push_back(cast_vec<T>(randn(5 * C, 712)));
    embedding_lookup_backward(f.ctx, view(dwte.back(), {f.Vp, C}), view(f.dout, {N, C}), view(f.tokens, {N}), 0, f.V);
    add_positions_backward(f.ctx, view(dwpe.back(), {5, C}), view(f.dout, {N, C}), 4, 2);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(dwte[0], dwte[1]);
  EXPECT_EQ(dwpe[0], dwpe[1]);
}

// N = 7 rows starting at flattened row 5 of sequences of length 4: positions
// 1, 2, 3, 0, 1, 2, 3, crossing a sequence boundary, with wpe longer (6 rows)
// than seq_len. In the backward two rows land on each of positions 1..3, and
// rows 4, 5 of dwpe must keep their values.
TYPED_TEST(EmbeddingShardTest, PositionsFromAnOffsetAcrossASequenceBoundary) {
  using T = TypeParam;
  const int64_t N = 7, C = 24, P = 6, seq_len = 4, row_offset = 5;
  KernelContext ctx;
  auto wpe = cast_vec<T>(randn(P * C, 720));
  auto x = cast_vec<T>(randn(N * C, 721));
  Vec want = ref_add_positions(to_f64(x), to_f64(wpe), N, C, seq_len, row_offset);
  add_positions(ctx, view(x, {N, C}), view(wpe, {P, C}), seq_len, row_offset);
  expect_near(x, want, tol<T>(kTolF32), "x + positions");

  auto dx = cast_vec<T>(randn(N * C, 722));
  auto dwpe = cast_vec<T>(randn(P * C, 723));
  Vec ref = to_f64(dwpe);
  ref_add_positions_backward(ref, to_f64(dx), N, C, seq_len, row_offset);
  add_positions_backward(ctx, view(dwpe, {P, C}), view(dx, {N, C}), seq_len, row_offset);
  expect_near(dwpe, ref, tol<T>(kTolF32), "dwpe");
}

// Sequence parallelism: runs of rows [0, 9), [9, 20), [20, 26) of B = 2
// sequences of 13, each with its row_offset, give the single call's result.
TYPED_TEST(EmbeddingShardTest, PositionsOverRunsOfRowsMatchOneCall) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t N = f.N, C = f.C, T_ = 13, P = 16;
  auto wpe = cast_vec<T>(randn(P * C, 730));
  auto whole = cast_vec<T>(randn(N * C, 731));
  auto runs = whole;
  add_positions(f.ctx, view(whole, {N, C}), view(wpe, {P, C}), T_, 0);
  for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 9}, {9, 20}, {20, 26}})
    add_positions(f.ctx, view(runs, {N, C}).slice(b, e), view(wpe, {P, C}), T_, b);
  EXPECT_EQ(runs, whole);
}

TEST(EmbeddingShardErrors, TokenOutsideVocabularyIsADataError) {
  KernelContext ctx;
  std::vector<int32_t> tokens = {1, 2, 11, 0};
  std::vector<float> shard(4 * 8), out(4 * 8), dout(4 * 8, 1.0f);
  // 11 is outside [0, 11) even though the shard [8, 12) covers row 11 (padding).
  expect_error([&] { embedding_lookup(ctx, view(out, {4, 8}), view(tokens, {4}), view(shard, {4, 8}), 8, 11); },
               ErrorKind::Data, {"embedding_lookup", "11", "position 2"});
  tokens[2] = -1;
  expect_error([&] {
    embedding_lookup_backward(ctx, view(shard, {4, 8}), view(dout, {4, 8}), view(tokens, {4}), 0, 11);
  }, ErrorKind::Data, {"embedding_lookup_backward", "-1", "position 2"});
}

TEST(EmbeddingShardErrors, ShapesNameTheOp) {
  KernelContext ctx;
  std::vector<int32_t> tokens = {1, 2, 3, 0};
  std::vector<float> shard(4 * 8), out(4 * 8), out5(5 * 8), out7(4 * 7), x(7 * 8), wpe(3 * 8), wpe9(4 * 9);
  std::vector<double> out_f64(4 * 8);
  expect_error([&] { embedding_lookup(ctx, view(out5, {5, 8}), view(tokens, {4}), view(shard, {4, 8}), 0, 11); },
               ErrorKind::Shape, {"embedding_lookup", "out"});
  expect_error([&] { embedding_lookup(ctx, view(out7, {4, 7}), view(tokens, {4}), view(shard, {4, 8}), 0, 11); },
               ErrorKind::Shape, {"embedding_lookup", "out"});
  expect_error([&] { embedding_lookup(ctx, view(out_f64, {4, 8}), view(tokens, {4}), view(shard, {4, 8}), 0, 11); },
               ErrorKind::Shape, {"embedding_lookup", "out", "f64"});
  expect_error([&] { embedding_lookup(ctx, view(out, {4, 8}), view(tokens, {4}), view(shard, {4, 8}), -4, 11); },
               ErrorKind::Shape, {"embedding_lookup", "vocab_begin"});
  // wpe must cover seq_len positions and match the row width.
  expect_error([&] { add_positions(ctx, view(x, {7, 8}), view(wpe, {3, 8}), 4, 0); }, ErrorKind::Shape,
               {"add_positions", "wpe"});
  expect_error([&] { add_positions(ctx, view(x, {7, 8}), view(wpe9, {4, 9}), 4, 0); }, ErrorKind::Shape,
               {"add_positions"});
  expect_error([&] { add_positions(ctx, view(x, {7, 8}), view(wpe, {3, 8}), 3, -1); }, ErrorKind::Shape,
               {"add_positions", "row_offset"});
  expect_error([&] { add_positions_backward(ctx, view(wpe9, {4, 9}), view(x, {7, 8}), 4, 0); }, ErrorKind::Shape,
               {"add_positions_backward", "dx"});
}

}  // namespace
}  // namespace xirang::test
