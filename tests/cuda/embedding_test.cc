// CUDA embedding pieces (vocabulary-shard lookup, positions) against the CPU
// ops in f64.
//
// Tolerances: the lookup copies rows, so it must be exact. The backward
// passes add, per table element, up to ~40 gradient rows in float (into the
// old value, or summed first and added once); each addition rounds by u_f32
// relative to a partial sum below 40 * max|dout| + |old|, so atol = 2e-5 *
// scale (scale = max(1, max|ref|)) bounds them with a wide margin, and rtol
// = u_S covers the one rounding to a 16-bit gradient. Adding positions is one rounded store:
// rtol = u_S + 2^-23 (float intermediate). A row sent to the wrong token or
// position is an O(1) error.
#include "kernels/cuda/ops.h"
#include "kernels/embedding.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

class EmbeddingTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(EmbeddingTest);

double rtol_for(DType s) { return s == DType::F32 ? 0.0 : unit_roundoff(s); }

// A shard holding rows [40, 90) of a 128-token vocabulary: tokens of other
// shards get zero rows.
TEST_P(EmbeddingTest, LookupOfAShard) {
  const DType S = GetParam();
  const int64_t N = 257, C = 37, begin = 40, rows = 50, V = 128;
  HostTensor tokens = random_tokens({N}, 1, 0, int32_t(V)), wte = random_host({rows, C}, S, 2);
  HostTensor ref(Shape{N, C}, DType::F64);
  embedding_lookup(cpu(), ref, tokens, host_cast(wte, DType::F64), begin, V);
  DeviceTensor out({N, C}, S);
  cuda::embedding_lookup(ctx(), out, to_device(tokens), to_device(wte), begin, V);
  expect_equal(to_host(out), ref, "embedding_lookup");
}

// Tokens drawn from [30, 60) over a shard of rows [40, 90): about 33 repeats
// per row and a third of the tokens in another shard. The gradient table is
// in S and in f32; a second run from the same start must match bit for bit.
TEST_P(EmbeddingTest, LookupBackwardAccumulatesRepeats) {
  const DType S = GetParam();
  const int64_t N = 1000, C = 37, begin = 40, rows = 50, V = 128;
  HostTensor tokens = random_tokens({N}, 3, 30, 60), dout = random_host({N, C}, S, 4);
  for (DType G : {S, DType::F32}) {
    HostTensor dwte = random_host({rows, C}, G, 5);
    HostTensor ref = host_cast(dwte, DType::F64);
    embedding_lookup_backward(cpu(), ref, host_cast(dout, DType::F64), tokens, begin, V);
    DeviceTensor tok_dev = to_device(tokens), dout_dev = to_device(dout);
    DeviceTensor first = to_device(dwte), second = to_device(dwte);
    cuda::embedding_lookup_backward(ctx(), first, dout_dev, tok_dev, begin, V);
    cuda::embedding_lookup_backward(ctx(), second, dout_dev, tok_dev, begin, V);
    HostTensor got = to_host(first);
    const std::string what = std::string("embedding_lookup_backward into ") + dtype_name(G);
    expect_close(got, ref, 2e-5 * scale_of(ref), rtol_for(G), what);
    expect_equal(to_host(second), got, what + ": second run differs");
  }
}

// The CUDA kernels rely on the loader's token validation (see
// kernels/cuda/embedding.cu); ids outside the vocabulary must still be
// harmless: a zero row forward, no gradient backward.
TEST_P(EmbeddingTest, OutOfVocabularyTokensAreInert) {
  const DType S = GetParam();
  const int64_t C = 9, rows = 8, V = 8;
  std::vector<double> ids = {3, -1, 8, 1000000, 5};
  HostTensor tokens = host_from(ids, {5}, DType::I32), wte = random_host({rows, C}, S, 6);
  DeviceTensor out({5, C}, S), wte_dev = to_device(wte), tok_dev = to_device(tokens);
  cuda::embedding_lookup(ctx(), out, tok_dev, wte_dev, 0, V);
  const std::vector<double> got = values(to_host(out)), table = values(wte);
  for (int64_t j = 0; j < C; ++j) {
    EXPECT_EQ(got[0 * C + j], table[3 * C + j]);
    EXPECT_EQ(got[1 * C + j], 0.0);
    EXPECT_EQ(got[2 * C + j], 0.0);
    EXPECT_EQ(got[3 * C + j], 0.0);
    EXPECT_EQ(got[4 * C + j], table[5 * C + j]);
  }
  HostTensor dwte = random_host({rows, C}, S, 7);
  DeviceTensor dwte_dev = to_device(dwte);
  cuda::embedding_lookup_backward(ctx(), dwte_dev, to_device(random_host({5, C}, S, 8)), tok_dev, 0, V);
  const std::vector<double> before = values(dwte), after = values(to_host(dwte_dev));
  for (int64_t r : {0, 1, 2, 4, 6, 7})
    for (int64_t j = 0; j < C; ++j) EXPECT_EQ(after[r * C + j], before[r * C + j]) << "row " << r;
}

// 26 rows starting at flattened row 12 of sequences of 7: positions wrap
// several times; x is (2, 13, C) to check that leading dims are rows.
TEST_P(EmbeddingTest, AddPositions) {
  const DType S = GetParam();
  const int64_t C = 37, T = 7, offset = 12;
  HostTensor x = random_host({2, 13, C}, S, 9), wpe = random_host({9, C}, S, 10);
  HostTensor ref = host_cast(x, DType::F64);
  add_positions(cpu(), ref, host_cast(wpe, DType::F64), T, offset);
  DeviceTensor x_dev = to_device(x);
  cuda::add_positions(ctx(), x_dev, to_device(wpe), T, offset);
  expect_close(to_host(x_dev), ref, 1e-30, unit_roundoff(S) + 0x1p-23, "add_positions");
}

TEST_P(EmbeddingTest, AddPositionsBackward) {
  const DType S = GetParam();
  const int64_t N = 26, C = 37, T = 7, offset = 12;
  HostTensor dx = random_host({N, C}, S, 11);
  for (DType G : {S, DType::F32}) {
    HostTensor dwpe = random_host({9, C}, G, 12);  // rows 7 and 8 are beyond seq_len: untouched
    HostTensor ref = host_cast(dwpe, DType::F64);
    add_positions_backward(cpu(), ref, host_cast(dx, DType::F64), T, offset);
    DeviceTensor dwpe_dev = to_device(dwpe);
    cuda::add_positions_backward(ctx(), dwpe_dev, to_device(dx), T, offset);
    expect_close(to_host(dwpe_dev), ref, 2e-5 * scale_of(ref), rtol_for(G),
                 std::string("add_positions_backward into ") + dtype_name(G));
  }
}

}  // namespace
}  // namespace xirang::test
