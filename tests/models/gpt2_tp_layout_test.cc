// Tensor-parallel layout of GPT2, without communication: shard shapes, the
// mapping of shards onto the single-rank tensors, and the per-rank memory
// plan's division by tp.
#include <gtest/gtest.h>

#include <set>

#include "models/gpt2.h"

namespace xirang {
namespace {

// A tensor-parallel group of `size` ranks seen from rank `rank`; layout and
// initialisation never communicate, so every operation is an error here.
class FakeGroup final : public Communicator {
 public:
  FakeGroup(int size, int rank) : size_(size), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  WorkPtr all_reduce_async(Tensor, ReduceOp) override { return fail_op(); }
  WorkPtr broadcast_async(Tensor, int) override { return fail_op(); }
  WorkPtr send_async(const Tensor&, int, int) override { return fail_op(); }
  WorkPtr recv_async(Tensor, int, int) override { return fail_op(); }
  void barrier() override { fail_op(); }

 protected:
  WorkPtr do_reduce_scatter(const Tensor&, Tensor, ReduceOp) override { return fail_op(); }
  WorkPtr do_all_gather(const Tensor&, Tensor) override { return fail_op(); }

 private:
  WorkPtr fail_op() { fail(ErrorKind::Comm, "FakeGroup does not communicate"); }
  int size_, rank_;
  std::string name_ = "tp";
};

const GPT2Shape kShape{4, 4, 64, 32, 250, 256};
const GPT2Batch kBatch{2, 16, 1};

struct Sizes {
  size_t params, acts;
};

Sizes measure(int tp, int rank, bool sp) {
  FakeGroup g(tp, rank);
  GPT2 m(kShape, GPT2Stage::whole(kShape), DType::F64, kBatch, {&g, sp});
  Arena p = Arena::measuring("p"), gr = Arena::measuring("g"), a = Arena::measuring("a");
  m.layout_parameters(p, gr);
  m.layout_activations(a);
  return {p.used(), a.used()};
}

// Bytes of the parts that tensor parallelism splits and of those it replicates,
// per token row for activations, computed from the architecture.
TEST(GPT2TensorParallel, MemoryPlanDividesTheSplitPartsByTp) {
  const double C = kShape.d_model, L = kShape.n_layer, V = kShape.padded_vocab, T = kBatch.seq_len;
  const double H = kShape.n_head, N = double(kBatch.micro_batch) * T, S = 8;  // f64
  const double split_params = V * C + L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C);
  const double repl_params = kShape.max_seq_len * C + L * (4 * C + C + C) + 2 * C;
  // Activations per token row. Split by tp: qkv 3C, probabilities H*T,
  // attention output C, MLP hidden 8C per layer, the logits V, and the 4C
  // backward scratch. Always whole: the row-parallel partial sums C and the
  // losses. Split by tp only under sequence parallelism: the residual rows
  // (stage input C and 2C per layer), LayerNorm statistics (4 per layer + 2),
  // residual gradients (2C) and the LayerNorm outputs (2C per layer + C; the
  // slots keep local rows, gathered again for backward). Sequence
  // parallelism adds one gathered LayerNorm output and one gathered gradient
  // (C each, whole); tp > 1 adds softmax statistics (3).
  const double split_acts = L * (3 * C + H * T + C + 8 * C) + V + 4 * C;
  const double whole_acts = C + 1;
  const double ln_acts = L * 2 * C + C;
  const double row_acts = C + L * (2 * C + 4) + 2 + 2 * C;
  const Sizes one = measure(1, 0, false);
  EXPECT_NEAR(double(one.acts), S * N * (split_acts + whole_acts + ln_acts + row_acts),
              0.01 * double(one.acts) + 64 * 1024);
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) {
      const Sizes s = measure(tp, tp - 1, sp);
      const double want_params = S * (repl_params + split_params / tp);
      EXPECT_NEAR(double(s.params), want_params, 0.01 * want_params + 64 * 1024) << "tp " << tp;
      const double want_acts =
          S * N * (split_acts / tp + whole_acts + (sp ? (row_acts + ln_acts) / tp + 2 * C : row_acts + ln_acts) + 3);
      EXPECT_NEAR(double(s.acts), want_acts, 0.01 * want_acts + 64 * 1024) << "tp " << tp << " sp " << sp;
      EXPECT_LT(double(s.acts), double(one.acts)) << "tp " << tp;
      EXPECT_LT(double(s.params), double(one.params) / tp * 1.3 + S * repl_params) << "tp " << tp;
    }
  }
}

// The shards of all ranks cover every element of every single-rank tensor
// exactly once (replicated tensors: each rank holds all of it).
TEST(GPT2TensorParallel, ShardsTileTheSingleRankTensors) {
  for (int tp : {2, 4}) {
    std::vector<std::set<int64_t>> covered;
    std::vector<int64_t> totals;
    for (int r = 0; r < tp; ++r) {
      FakeGroup g(tp, r);
      GPT2 m(kShape, GPT2Stage::whole(kShape), DType::F64, kBatch, {&g, false});
      auto& ps = m.parameters();
      if (covered.empty()) {
        covered.resize(ps.size());
        for (auto& p : ps) totals.push_back(p.shard.global.numel());
      }
      for (size_t k = 0; k < ps.size(); ++k) {
        const Parameter& p = ps[k];
        if (p.shard.replicated()) {
          EXPECT_EQ(p.value.numel(), p.shard.global.numel()) << p.name;
          continue;
        }
        for (int64_t i = 0; i < p.value.numel(); ++i) {
          const int64_t gi = p.shard.global_index(p.value.shape(), i);
          ASSERT_TRUE(0 <= gi && gi < totals[k]) << p.name;
          EXPECT_TRUE(covered[k].insert(gi).second) << p.name << " element " << gi << " held twice";
        }
      }
    }
    FakeGroup g(tp, 0);
    GPT2 m(kShape, GPT2Stage::whole(kShape), DType::F64, kBatch, {&g, false});
    for (size_t k = 0; k < m.parameters().size(); ++k) {
      if (!m.parameters()[k].shard.replicated()) {
        EXPECT_EQ(int64_t(covered[k].size()), totals[k]) << m.parameters()[k].name << " tp " << tp;
      }
    }
  }
}

// Rank r's QKV rows are the q, k and v rows of heads [r H/P, (r+1) H/P).
TEST(GPT2TensorParallel, QkvShardHoldsItsHeadsOfQKAndV) {
  const int tp = 2, C = kShape.d_model;
  FakeGroup g(tp, 1);
  GPT2 m(kShape, GPT2Stage::whole(kShape), DType::F64, kBatch, {&g, false});
  const Parameter* qkv = nullptr;
  for (auto& p : m.parameters())
    if (p.name == "h.0.attn.c_attn.weight") qkv = &p;
  ASSERT_NE(qkv, nullptr);
  const Shape local = qkv->value.shape();
  ASSERT_EQ(local[0], 3 * C / tp);
  const int64_t rows_per_part = C / tp;
  for (int part = 0; part < 3; ++part) {
    const int64_t local_row = part * rows_per_part;  // first row of q, k, v in the shard
    const int64_t g_row = qkv->shard.global_index(local, local_row * C) / C;
    EXPECT_EQ(g_row, part * C + 1 * rows_per_part) << "part " << part;
  }
}

TEST(GPT2TensorParallel, InitialisedShardsEqualSlicesOfTheSingleRankModel) {
  GPT2 whole(kShape, GPT2Stage::whole(kShape), DType::F64, kBatch);
  Arena p1("p", 1 << 22), g1("g", 1 << 22);
  whole.layout_parameters(p1, g1);
  whole.init_parameters(5);
  for (int r = 0; r < 4; ++r) {
    FakeGroup g(4, r);
    GPT2 shard(kShape, GPT2Stage::whole(kShape), DType::F64, kBatch, {&g, false});
    Arena p("p", 1 << 22), gr("g", 1 << 22);
    shard.layout_parameters(p, gr);
    shard.init_parameters(5);
    for (size_t k = 0; k < shard.parameters().size(); ++k) {
      const Parameter& s = shard.parameters()[k];
      const double* full = whole.parameters()[k].value.data<double>();
      const double* v = s.value.data<double>();
      for (int64_t i = 0; i < s.value.numel(); ++i)
        ASSERT_EQ(v[i], full[s.shard.global_index(s.value.shape(), i)]) << s.name << " rank " << r << " element " << i;
    }
  }
}

}  // namespace
}  // namespace xirang
