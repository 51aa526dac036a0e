// The model interface (models/model.h): the architecture registry, the
// communicator-free parameter lists, tied parameters, the layout rules
// stated once, and the parameters' init rules.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/rng.h"
#include "models/gpt2/gpt2.h"
#include "models/model.h"
#include "tests/support/expect_error.h"

namespace xirang {
namespace {

const ModelDims kDims{.n_layer = 4, .n_head = 4, .d_model = 32, .max_seq_len = 16, .vocab_size = 250};

TEST(ModelRegistry, FindsGpt2AndNamesTheKnownArchitectures) {
  EXPECT_EQ(model_arch("gpt2").name, "gpt2");
  EXPECT_EQ(model_arch("llama").name, "llama");
  EXPECT_TRUE(model_arch_known("gpt2"));
  EXPECT_TRUE(model_arch_known("llama"));
  EXPECT_FALSE(model_arch_known("bert"));
  expect_error([] { model_arch("bert"); }, ErrorKind::Config, {"model.arch='bert'", "supported: gpt2, llama"});
}

// Each preset has the parameter count of the model it names (transformers'
// num_parameters() of the published checkpoint: the vocabulary unpadded, a
// tied head counted once), so a wrong width, depth, head count or tie in a
// preset fails here. Every preset fits one rank and tensor parallelism of 8.
TEST(ModelPresets, HaveThePublishedParameterCounts) {
  const std::vector<std::pair<std::string, int64_t>> published = {
      {"gpt2_124m", 124439808},       {"gpt2_350m", 354823168},       {"gpt2_774m", 774030080},
      {"gpt2_1558m", 1557611200},     {"llama2_7b", 6738415616},      {"llama3_8b", 8030261248},
      {"llama3_70b", 70553706496},    {"llama3.1_8b", 8030261248},    {"llama3.2_1b", 1235814400},
      {"qwen3_0.6b", 596049920},      {"qwen3_1.7b", 1720574976},     {"qwen3_4b", 4022468096},
      {"qwen3_8b", 8190735360}};
  std::string names;
  for (const auto& [name, count] : published) {
    SCOPED_TRACE(name);
    names += (names.empty() ? "" : ", ") + name;
    const ModelPreset& p = find_model_preset(name);
    const ModelDims& d = p.dims;
    EXPECT_EQ(d.preset, name);
    int64_t n = 0;  // less the padding rows of the token table and an untied head
    for (const Parameter& q : model_arch(d.arch).parameters(d, ChunkPlacement::whole(d.n_layer), 1, 0)) {
      const Shape& g = q.shard.global;
      n += g.numel();
      if (g.rank() == 2 && g[0] == d.padded_vocab()) n -= int64_t(d.padded_vocab() - d.vocab_size) * g[1];
    }
    EXPECT_EQ(n, count);
    EXPECT_EQ(layout_problem(d, ParallelLayout{}), "");
    if (d.n_head % 8 == 0) EXPECT_EQ(layout_problem(d, ParallelLayout{1, 8, 1, 1}), "");
  }
  EXPECT_EQ(model_preset_names(), names);  // every preset is counted above
  expect_error([] { find_model_preset("llama4"); }, ErrorKind::Config,
               {"model.preset='llama4' is not a preset (presets: gpt2_124m, gpt2_350m"});
}

// The storage-free list is the one a chunk trains: same names, shapes,
// shards, init rules and tie flags, for every tp rank and pipeline chunk.
TEST(ModelRegistry, ParameterListsMatchTheChunksWithoutACommunicator) {
  const ModelArch& arch = model_arch("gpt2");
  for (int tp : {1, 2, 4})
    for (int chunks : {1, 2, 4})
      for (int g = 0; g < chunks; ++g)
        for (int r = 0; r < tp; ++r) {
          const ChunkPlacement at = ChunkPlacement::of_chunk(kDims.n_layer, chunks, g);
          const auto list = arch.parameters(kDims, at, tp, r);
          auto chunk = arch.make_chunk(kDims, at, DType::F32, ChunkBatch{2, 8, 1},
                                       TensorParallel{nullptr, false, tp, r});
          const auto& ps = chunk->parameters();
          ASSERT_EQ(list.size(), ps.size()) << "tp " << tp << " chunk " << g << "/" << chunks;
          for (size_t k = 0; k < ps.size(); ++k) {
            SCOPED_TRACE(ps[k].name);
            EXPECT_EQ(list[k].name, ps[k].name);
            EXPECT_EQ(list[k].value.shape(), ps[k].value.shape());
            EXPECT_EQ(list[k].shard.global, ps[k].shard.global);
            EXPECT_EQ(list[k].shard.index, r * int(!ps[k].shard.replicated()));
            EXPECT_EQ(list[k].init.kind, ps[k].init.kind);
            EXPECT_EQ(list[k].init.std, ps[k].init.std);
            EXPECT_EQ(list[k].tied, ps[k].tied);
            EXPECT_EQ(list[k].tied_copy, ps[k].tied_copy);
          }
        }
}

// The token table is tied to the head: the first and last chunks each hold
// it (the last a copy) unless one chunk holds both.
TEST(ModelChunkTies, FirstAndLastChunksHoldTheTokenTable) {
  const ModelArch& arch = model_arch("gpt2");
  auto whole = arch.make_chunk(kDims, ChunkPlacement::whole(kDims.n_layer), DType::F32, ChunkBatch{2, 8, 1}, {});
  EXPECT_TRUE(whole->tied_parameters().empty());
  for (int g : {0, 1, 2, 3}) {
    auto c = arch.make_chunk(kDims, ChunkPlacement::of_chunk(kDims.n_layer, 4, g), DType::F32, ChunkBatch{2, 8, 1}, {});
    const auto tied = c->tied_parameters();
    if (g == 1 || g == 2) {
      EXPECT_TRUE(tied.empty()) << "chunk " << g;
      continue;
    }
    ASSERT_EQ(tied.size(), 1u) << "chunk " << g;
    EXPECT_EQ(tied[0]->name, "wte.weight");
    EXPECT_EQ(tied[0]->layer, -1);
    EXPECT_EQ(tied[0]->tied_copy, g == 3) << "the last chunk holds the copy";
  }
}

TEST(ModelLayout, EveryRuleIsStatedOnceWithConfigKeys) {
  auto problem = [](ModelDims d, ParallelLayout l) { return layout_problem(d, l); };
  EXPECT_EQ(problem(kDims, {2, 2, 2, 2}), "");
  EXPECT_NE(problem(kDims, {1, 3, 1, 1}).find("model.n_head=4 is not divisible by parallel.tp=3"), std::string::npos);
  ModelDims odd = kDims;
  odd.vocab_multiple = 2;  // 250 pads to 250
  EXPECT_NE(problem(odd, {1, 4, 1, 1}).find("padded vocabulary 250"), std::string::npos);
  EXPECT_NE(problem(kDims, {1, 1, 3, 1}).find("model.n_layer=4 is not divisible by parallel.pp (3)"),
            std::string::npos);
  EXPECT_NE(problem(kDims, {1, 1, 1, 2}).find("needs parallel.pp > 1"), std::string::npos);
  ModelDims heads = kDims;
  heads.d_model = 30;
  EXPECT_NE(problem(heads, {1, 1, 1, 1}).find("model.d_model=30 is not divisible by model.n_head=4"),
            std::string::npos);
  expect_error([] { check_layout(kDims, {1, 3, 1, 1}); }, ErrorKind::Config, {"parallel.tp=3"});
}

// Each element is f(seed, name, global index): zeros, ones, and normals of
// the rule's deviation with the padding rows of the token table left zero.
TEST(ModelInit, InitRulesDrawFromTheGlobalIndex) {
  auto chunk = model_arch("gpt2").make_chunk(kDims, ChunkPlacement::whole(kDims.n_layer), DType::F64,
                                             ChunkBatch{2, 8, 1}, {});
  Arena p = Arena::measuring("p"), g = Arena::measuring("g");
  chunk->layout_parameters(p, g);
  Arena pa("p", p.used()), ga("g", g.used());
  chunk->layout_parameters(pa, ga);
  chunk->init_parameters(11);
  for (const Parameter& prm : chunk->parameters()) {
    SCOPED_TRACE(prm.name);
    const double* v = prm.value.data<double>();
    const double std = prm.name.find("c_proj.weight") != std::string::npos ? 0.02 / std::sqrt(8.0)
                       : prm.name == "wpe.weight"                          ? 0.01
                                                                           : 0.02;
    for (int64_t i = 0; i < prm.value.numel(); i += 7) {
      if (prm.name.find(".bias") != std::string::npos) {
        ASSERT_EQ(v[i], 0.0);
      } else if (prm.name.find("ln_") != std::string::npos) {
        ASSERT_EQ(v[i], 1.0);
      } else if (prm.name == "wte.weight" && i >= int64_t(kDims.vocab_size) * kDims.d_model) {
        ASSERT_EQ(v[i], 0.0) << "padding row";
      } else {
        ASSERT_EQ(v[i], std * rng_normal(11, name_stream(prm.name), uint64_t(i)));
      }
    }
  }
}

TEST(ModelLayers, UnbuiltPiecesAreRefusedWithTheirReason) {
  expect_error([] { CausalSelfAttention a(8, 3, 16, 1); }, ErrorKind::Internal, {"n_kv_head 3 must divide n_head 8"});
  expect_error([] { CausalSelfAttention a(8, 2, 16, 4); }, ErrorKind::Internal, {"tp 4 must divide"});
  ModelDims gqa = kDims;
  gqa.n_kv_head = 2;
  expect_error([&] { model_arch("gpt2").parameters(gqa, ChunkPlacement::whole(4), 1, 0); }, ErrorKind::Internal,
               {"grouped-query"});
}

TEST(ModelChunk, ALayoutOnlyChunkRefusesToRun) {
  auto chunk = model_arch("gpt2").make_chunk(kDims, ChunkPlacement::whole(kDims.n_layer), DType::F32,
                                             ChunkBatch{2, 8, 1}, TensorParallel{nullptr, false, 2, 1});
  EXPECT_EQ(chunk->parameters().front().value.shape(), (Shape{128, 32})) << "rank 1 of 2 holds half the table";
  expect_error([&] { chunk->forward(KernelContext{}, 0, Tensor(), Tensor(), 0.0); }, ErrorKind::Internal,
               {"without its tensor-parallel group"});
}

}  // namespace
}  // namespace xirang
