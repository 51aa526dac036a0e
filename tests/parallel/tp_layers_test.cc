// Tensor-parallel layers against the unsharded model, under MPI with tp = the
// world size (2 and 4): the vocabulary-parallel embedding and cross entropy
// with the tied head (a model without blocks), and the column- and
// row-parallel projections with split heads (one block), each with and
// without sequence parallelism; and a LLaMA block (RMSNorm, q/k/v in
// unequal blocks under grouped-query attention, rotary embeddings, the
// stacked gate/up projection, the untied vocabulary-parallel head). In
// float64, the loss and every gradient shard must equal the single-rank
// model's to rounding.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "comm/process_grid.h"
#include "core/rng.h"
#include "models/gpt2/gpt2.h"
#include "models/llama/llama.h"
#include "models/qwen3/qwen3.h"
#include "tests/models/model_fixture.h"

namespace xirang {
namespace {

// An F64 model in its own arenas, with random parameters that are a function
// of the global element index (so the shards are slices of the unsharded model).
template <class Arch = GPT2>
struct Model {
  ChunkInArenas<Arch> built;
  Arch& m = built.model;
  Model(const ModelDims& s, const ChunkBatch& b, TensorParallel par) : built(s, ChunkPlacement::whole(s.n_layer), DType::F64, b, par) {
    randomize_parameters(m, 17);
  }
};

// `split`: the sharded model's backward runs as its input-gradient part and
// then its weight-gradient part (BackwardPart), which must also equal a
// fused sharded backward bit for bit.
template <class Arch = GPT2>
void check_layers(int n_layer, bool sequence_parallel, bool split = false) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ModelDims shape{.n_layer = n_layer, .n_head = 4, .d_model = 16, .max_seq_len = 8, .vocab_size = 50, .vocab_multiple = 64};
  if constexpr (std::is_same_v<Arch, Llama>) {
    // 8 query heads on 4 key/value heads: tp 4 leaves each rank 2 on 1.
    shape = ModelDims{.arch = "llama", .n_layer = n_layer, .n_head = 8, .n_kv_head = 4, .d_model = 32,
                      .ffn_hidden = 48, .max_seq_len = 8, .vocab_size = 50, .vocab_multiple = 64};
    shape.rope = RopeConfig{10000.0, RopeScaling::llama3(4, 1, 2, 4)};
  }
  if constexpr (std::is_same_v<Arch, Qwen3>) {
    // LLaMA's shape with heads 6 wide and a q/k norm whose weight gradients sum over the ranks' heads.
    shape = ModelDims{.arch = "qwen3", .n_layer = n_layer, .n_head = 8, .n_kv_head = 4, .head_dim = 6,
                      .d_model = 32, .ffn_hidden = 48, .max_seq_len = 8, .vocab_size = 50, .vocab_multiple = 64,
                      .norm_eps = 1e-6};
  }
  const ChunkBatch batch{2, 8, 1, Recompute::None, split};
  std::vector<int32_t> tokens(16), targets(16);
  for (int i = 0; i < 16; ++i) {
    tokens[size_t(i)] = int32_t(rng_below(3, 1, uint64_t(i), 50));
    targets[size_t(i)] = int32_t(rng_below(3, 2, uint64_t(i), 50));
  }
  Tensor tk(tokens.data(), {2, 8}, DType::I32), tg(targets.data(), {2, 8}, DType::I32);
  KernelContext ctx;

  Model<Arch> whole(shape, batch, {});
  whole.m.forward(ctx, 0, tk, tg, 1.0 / 16);
  const double ref_loss = whole.m.take_loss(ctx);
  whole.m.backward(ctx, 0, tk);

  auto grid = ProcessGrid::create_mpi(GridShape{1, world, 1}, CommOptions{.timeout_s = 60});
  Model<Arch> shard(shape, batch, {&grid->tp(), sequence_parallel});
  shard.m.forward(ctx, 0, tk, tg, 1.0 / 16);
  const double loss = shard.m.take_loss(ctx);
  if (split) {
    shard.m.backward(ctx, 0, tk, GradPhase::Final, Tensor(), BackwardPart::InputGrad);
    shard.m.backward(ctx, 0, tk, GradPhase::Final, Tensor(), BackwardPart::WeightGrad);
    Model<Arch> fused(shape, ChunkBatch{2, 8, 1}, {&grid->tp(), sequence_parallel});
    fused.m.forward(ctx, 0, tk, tg, 1.0 / 16);
    fused.m.take_loss(ctx);
    fused.m.backward(ctx, 0, tk);
    for (size_t k = 0; k < fused.m.parameters().size(); ++k) {
      const Tensor& a = shard.m.parameters()[k].grad;
      const Tensor& b = fused.m.parameters()[k].grad;
      EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.bytes()), 0) << shard.m.parameters()[k].name << ": split vs fused";
    }
  } else {
    shard.m.backward(ctx, 0, tk);
  }
  EXPECT_NEAR(loss, ref_loss, 1e-12 * std::abs(ref_loss));

  std::vector<Parameter>& ps = shard.m.parameters();
  std::vector<Parameter>& ws = whole.m.parameters();
  ASSERT_EQ(ps.size(), ws.size());
  for (size_t k = 0; k < ps.size(); ++k) {
    ASSERT_EQ(ps[k].name, ws[k].name);
    const double* g = ps[k].grad.data<double>();
    const double* ref = ws[k].grad.data<double>();
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < ps[k].grad.numel(); ++i) {
      const double r = ref[ps[k].shard.global_index(ps[k].grad.shape(), i)];
      diff = std::max(diff, std::abs(g[i] - r));
      scale = std::max(scale, std::abs(r));
    }
    EXPECT_GT(scale, 0.0) << ps[k].name << ": an all-zero reference gradient proves nothing";
    EXPECT_LE(diff, 1e-10 * scale) << ps[k].name << " (tp " << world << ", sp " << sequence_parallel << ")";
  }
}

TEST(TensorParallelLayers, VocabParallelEmbeddingAndCrossEntropy) { check_layers(0, false); }
TEST(TensorParallelLayers, VocabParallelEmbeddingAndCrossEntropySequenceParallel) { check_layers(0, true); }
TEST(TensorParallelLayers, ColumnAndRowParallelBlock) { check_layers(1, false); }
TEST(TensorParallelLayers, ColumnAndRowParallelBlockSequenceParallel) { check_layers(1, true); }
TEST(TensorParallelLayers, TwoBlocksSequenceParallel) { check_layers(2, true); }
TEST(TensorParallelLayers, LlamaBlock) { check_layers<Llama>(1, false); }
TEST(TensorParallelLayers, LlamaBlockSequenceParallel) { check_layers<Llama>(1, true); }
TEST(TensorParallelLayers, Qwen3Block) { check_layers<Qwen3>(1, false); }
TEST(TensorParallelLayers, SplitBackwardSequenceParallel) { check_layers(2, true, true); }
TEST(TensorParallelLayers, Qwen3SplitBackward) { check_layers<Qwen3>(1, false, true); }
TEST(TensorParallelLayers, Qwen3SplitBackwardSequenceParallel) { check_layers<Qwen3>(2, true, true); }
TEST(TensorParallelLayers, Qwen3BlocksSequenceParallel) { check_layers<Qwen3>(2, true); }

}  // namespace
}  // namespace xirang
