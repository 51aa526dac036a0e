// Offline checkpoint conversion between layouts: resharding (each rank file
// holds exactly what that rank of the new layout holds; reading back is
// bitwise the source), interleaved stages, bf16 storage, and dropping the
// optimizer state.
#include <gtest/gtest.h>

#include "tests/runtime/convert_fixture.h"

namespace xirang::convert_test {
namespace {

TEST(CheckpointConvert, ReshardToTp2Pp2Dp2Zero1HoldsEachRanksSlices) {
  const std::string dir = fresh_test_dir("ck");
  const Source s = make_source(1);
  write_source(s, dir + "/src", 7);
  ConvertOptions o;
  o.layout = CheckpointLayout{2, 2, 2, 1, 1, false};
  const ConvertResult res = reshard_checkpoint(dir + "/src", dir + "/dst", o);
  EXPECT_TRUE(fs::equivalent(res.path, dir + "/dst/step_00000007"));
  EXPECT_TRUE(res.optimizer_state);
  EXPECT_FALSE(fs::exists(dir + "/dst.converting"));
  const CheckpointReader r = CheckpointReader::open(res.path);
  EXPECT_EQ(r.step(), 7);
  EXPECT_EQ(r.meta().rank_files.size(), 8u);
  EXPECT_EQ(r.meta().layout.tp, 2);
  EXPECT_EQ(r.meta().layout.pp, 2);
  EXPECT_EQ(r.meta().layout.dp, 2);
  EXPECT_EQ(r.meta().layout.zero, 1);
  EXPECT_EQ(r.meta().config_yaml, test_config().yaml);
  EXPECT_EQ(CheckpointDir(dir + "/dst").latest().value_or("none"), CheckpointDir(dir + "/dst").step_dir(7));

  // Pipeline stage 0 holds the embeddings and blocks 0-1; stage 1 blocks 2-3
  // and the final norm (its copy of the tied token table is not saved).
  std::set<std::string> stage0{"wte.weight", "wpe.weight"}, stage1{"ln_f.weight", "ln_f.bias"};
  for (int l : {0, 1})
    for (auto& n : block_names(l)) stage0.insert(n);
  for (int l : {2, 3})
    for (auto& n : block_names(l)) stage1.insert(n);
  std::map<int, std::map<std::string, std::set<std::string>>> seen;  // rank -> group -> names
  for (const CheckpointEntry& e : r.entries()) {
    const GridCoords at = grid_coords(GridShape{2, 2, 2}, e.rank);
    EXPECT_TRUE((at.pp == 0 ? stage0 : stage1).count(e.name)) << e.name << " on rank " << e.rank;
    const int dim = split_dim(e.name);
    EXPECT_EQ(e.shard.dim, dim) << e.name;
    EXPECT_EQ(e.shard.parts, dim < 0 ? 1 : 2) << e.name;
    EXPECT_EQ(e.shard.index, dim < 0 ? 0 : at.tp) << e.name;
    EXPECT_EQ(e.shard.blocks, e.name.find("c_attn") != std::string::npos ? 3 : 1) << e.name;
    EXPECT_EQ(e.dtype, DType::F32);
    if (e.group == "params") {
      EXPECT_EQ(at.dp, 0) << "parameters are saved by dp rank 0 only";
      EXPECT_EQ(e.flat_begin, 0);
      EXPECT_EQ(e.flat_end, e.local.numel());
    } else {
      ASSERT_TRUE(e.group == "adam_m" || e.group == "adam_v") << e.group;
      const auto [b, end] = split_range(e.local.numel(), 2, at.dp);  // ZeRO-1: an even half per dp rank
      EXPECT_EQ(e.flat_begin, b) << e.name;
      EXPECT_EQ(e.flat_end, end) << e.name;
    }
    // Each stored element is the source's element at the global index the entry claims.
    const std::vector<float>& global = (e.group == "params" ? s.param : e.group == "adam_m" ? s.m : s.v).at(e.name);
    const std::vector<float> got = stored_values(e);
    const ShardMap map(e.shard);
    int64_t wrong = 0;
    for (int64_t i = 0; i < e.numel(); ++i) wrong += got[size_t(i)] != global[size_t(map.to_global(e.flat_begin + i))];
    EXPECT_EQ(wrong, 0) << e.group << "/" << e.name << " on rank " << e.rank;
    seen[e.rank][e.group].insert(e.name);
  }
  for (int rank = 0; rank < 8; ++rank) {
    const GridCoords at = grid_coords(GridShape{2, 2, 2}, rank);
    const std::set<std::string>& stage = at.pp == 0 ? stage0 : stage1;
    if (at.dp == 0) EXPECT_EQ(seen[rank]["params"], stage) << "rank " << rank;
    else EXPECT_EQ(seen[rank].count("params"), 0u) << "rank " << rank;
    EXPECT_EQ(seen[rank]["adam_m"], stage) << "rank " << rank;
    EXPECT_EQ(seen[rank]["adam_v"], stage) << "rank " << rank;
    EXPECT_EQ(r.get_int(rank, "train.step"), 7);
    EXPECT_EQ(r.get_double(rank, "test.scale"), 0.25);
  }

  // Read back in the one-rank layout: bitwise the source.
  for (const Parameter& p : s.params) {
    EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name))) << p.name;
    EXPECT_TRUE(bitwise_equal(read_whole(r, "adam_m", p), s.m.at(p.name))) << p.name;
    EXPECT_TRUE(bitwise_equal(read_whole(r, "adam_v", p), s.v.at(p.name))) << p.name;
  }
  // And converted back to one rank from the eight files.
  o.layout = CheckpointLayout{};
  const CheckpointReader back = CheckpointReader::open(reshard_checkpoint(dir + "/dst", dir + "/back", o).path);
  EXPECT_EQ(back.meta().rank_files.size(), 1u);
  for (const CheckpointEntry& e : back.entries()) {
    EXPECT_EQ(e.rank, 0);
    EXPECT_TRUE(e.shard.replicated()) << e.name;
  }
  for (const Parameter& p : s.params) {
    EXPECT_TRUE(bitwise_equal(read_whole(back, "params", p), s.param.at(p.name))) << p.name;
    EXPECT_TRUE(bitwise_equal(read_whole(back, "adam_v", p), s.v.at(p.name))) << p.name;
  }
}

TEST(CheckpointConvert, InterleavedStagesHoldTheTrainersChunks) {
  // 4 layers in pp 2 x 2 virtual stages = 4 chunks of one layer; model chunk
  // g lives on pipeline rank g % 2, so rank 0 holds layers 0 and 2, rank 1
  // layers 1 and 3 plus the head (whose token table is the tied copy).
  const CheckpointLayout layout{1, 1, 2, 0, 2, false};
  std::vector<std::string> want0{"wte.weight", "wpe.weight"}, want1;
  for (auto& n : block_names(0)) want0.push_back(n);
  for (auto& n : block_names(2)) want0.push_back(n);
  for (auto& n : block_names(1)) want1.push_back(n);
  want1.push_back("wte.weight");
  for (auto& n : block_names(3)) want1.push_back(n);
  want1.push_back("ln_f.weight");
  want1.push_back("ln_f.bias");
  std::vector<std::string> got0, got1;
  for (const Parameter& p : rank_parameters(test_shape(), layout, 0)) {
    got0.push_back(p.name);
    EXPECT_FALSE(p.tied_copy) << p.name;
  }
  for (const Parameter& p : rank_parameters(test_shape(), layout, 1)) {
    got1.push_back(p.name);
    EXPECT_EQ(p.tied_copy, p.name == "wte.weight") << p.name;
  }
  EXPECT_EQ(got0, want0);
  EXPECT_EQ(got1, want1);

  const std::string dir = fresh_test_dir("ck");
  const Source s = make_source(2);
  write_source(s, dir + "/src", 3);
  ConvertOptions o;
  o.layout = layout;
  const CheckpointReader r = CheckpointReader::open(reshard_checkpoint(dir + "/src", dir + "/dst", o).path);
  EXPECT_EQ(r.meta().layout.virtual_stages, 2);
  for (const CheckpointEntry& e : r.entries()) {
    const auto& want = e.rank == 0 ? want0 : want1;
    EXPECT_NE(std::find(want.begin(), want.end(), e.name), want.end()) << e.name << " on rank " << e.rank;
    EXPECT_FALSE(e.rank == 1 && e.name == "wte.weight") << "the tied copy is saved by the first stage only";
  }
  for (const Parameter& p : s.params) EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name)));
}

TEST(CheckpointConvert, VStagesHoldTheTrainersChunks) {
  // zb_v's V: 4 layers in pp 2 x 2 chunks of one layer; rank r holds model
  // chunks r and 3 - r, so rank 0 holds layers 0 and 3 with the embedding
  // and the head (both copies of the tied table: the copy is the head's),
  // rank 1 layers 1 and 2. The layout's chunk order survives meta.json.
  CheckpointLayout layout{1, 1, 2, 0, 2, false};
  layout.chunk_order = ChunkOrder::V;
  std::vector<std::string> want0{"wte.weight", "wpe.weight"}, want1;
  for (auto& n : block_names(0)) want0.push_back(n);
  want0.push_back("wte.weight");
  for (auto& n : block_names(3)) want0.push_back(n);
  want0.push_back("ln_f.weight");
  want0.push_back("ln_f.bias");
  for (auto& n : block_names(1)) want1.push_back(n);
  for (auto& n : block_names(2)) want1.push_back(n);
  std::vector<std::string> got0, got1;
  int copies = 0;
  for (const Parameter& p : rank_parameters(test_shape(), layout, 0)) {
    got0.push_back(p.name);
    copies += p.tied_copy;
  }
  for (const Parameter& p : rank_parameters(test_shape(), layout, 1)) got1.push_back(p.name);
  EXPECT_EQ(got0, want0);
  EXPECT_EQ(got1, want1);
  EXPECT_EQ(copies, 1);

  const std::string dir = fresh_test_dir("ck");
  const Source s = make_source(2);
  write_source(s, dir + "/src", 3);
  ConvertOptions o;
  o.layout = layout;
  const CheckpointReader r = CheckpointReader::open(reshard_checkpoint(dir + "/src", dir + "/dst", o).path);
  EXPECT_EQ(r.meta().layout.chunk_order, ChunkOrder::V);
  for (const CheckpointEntry& e : r.entries()) {
    const auto& want = e.rank == 0 ? want0 : want1;
    EXPECT_NE(std::find(want.begin(), want.end(), e.name), want.end()) << e.name << " on rank " << e.rank;
  }
  for (const Parameter& p : s.params) EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name)));
  // A V needs two chunks on each of two or more ranks.
  layout.virtual_stages = 1;
  EXPECT_THROW(rank_parameters(test_shape(), layout, 0), Error);
}

TEST(CheckpointConvert, Bf16ParametersRoundLikeConvertElements) {
  const std::string dir = fresh_test_dir("ck");
  const Source s = make_source(3);
  write_source(s, dir + "/src", 5);
  ConvertOptions o;
  o.dtype = DType::BF16;
  const ConvertResult res = reshard_checkpoint(dir + "/src", dir + "/dst", o);
  EXPECT_EQ(res.layout.world_size(), 1);  // the source's layout
  const CheckpointReader r = CheckpointReader::open(res.path);
  for (const CheckpointEntry& e : r.entries()) EXPECT_EQ(e.dtype, e.group == "params" ? DType::BF16 : DType::F32) << e.name;
  int64_t changed = 0;
  for (const Parameter& p : s.params) {
    const std::vector<float>& src = s.param.at(p.name);
    std::vector<uint16_t> half(src.size());
    std::vector<float> want(src.size());
    convert_elements(src.data(), DType::F32, half.data(), DType::BF16, int64_t(src.size()));
    convert_elements(half.data(), DType::BF16, want.data(), DType::F32, int64_t(src.size()));
    EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), want)) << p.name;
    EXPECT_TRUE(bitwise_equal(read_whole(r, "adam_m", p), s.m.at(p.name))) << "optimizer state stays f32: " << p.name;
    changed += !bitwise_equal(want, src);
  }
  EXPECT_GT(changed, 0) << "the rounding should change the random values";
}

TEST(CheckpointConvert, ParamsOnlyDropsTheOptimizerState) {
  const std::string dir = fresh_test_dir("ck");
  const Source s = make_source(4);
  write_source(s, dir + "/src", 9);
  ConvertOptions o;
  o.params_only = true;
  o.layout = CheckpointLayout{2, 1, 1, 1, 1, false};
  const ConvertResult res = reshard_checkpoint(dir + "/src", dir + "/dst", o);
  EXPECT_FALSE(res.optimizer_state);
  const CheckpointReader r = CheckpointReader::open(res.path);
  for (const CheckpointEntry& e : r.entries()) {
    EXPECT_EQ(e.group, "params");
    EXPECT_EQ(e.rank, 0);
  }
  EXPECT_EQ(r.get_int(1, "train.step"), 9);
  for (const Parameter& p : s.params) EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name)));
}

// ---------------------------------------------------------------------------
// Safetensors

}  // namespace
}  // namespace xirang::convert_test
