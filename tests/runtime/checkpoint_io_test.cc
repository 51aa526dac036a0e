// Checkpoint storage: any layout saves, any layout loads (tensor-parallel
// shards, fused-QKV blocks, column splits, replicas, ZeRO pieces); atomic
// commit and pruning; corruption, truncation, shape and coverage errors;
// bf16 storage. One process plays every rank by writing every rank file.
#include "runtime/checkpoint/checkpoint_io.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/checkpoint/hdf5_check.h"

#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& tag = "data") { return testing_util::fresh_test_dir(tag); }

// Random values in +-[0.1, 1): never zero, so a missed copy shows.
std::vector<float> random_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mag(0.1f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = (rng() & 1 ? 1.0f : -1.0f) * mag(rng);
  return v;
}

Tensor view_of(std::vector<float>& v, Shape s) { return Tensor(v.data(), s, DType::F32); }

// The local shard of `global` under `s`, built with the model's own mapping.
std::vector<float> local_of(const std::vector<float>& global, const ShardSpec& s) {
  const Shape local = s.local_shape();
  std::vector<float> out(size_t(local.numel()));
  for (int64_t i = 0; i < local.numel(); ++i) out[size_t(i)] = global[size_t(s.global_index(local, i))];
  return out;
}

ShardSpec split(Shape g, int dim, int parts, int index, int blocks = 1) { return ShardSpec::split(g, dim, parts, index, blocks); }
ShardSpec whole(Shape g) { return ShardSpec::whole(g); }

CheckpointMeta meta_for(int64_t step, int dp, int tp) {
  CheckpointMeta m;
  m.step = step;
  m.layout.dp = dp;
  m.layout.tp = tp;
  m.config_yaml = "model:\n  n_layer: 2\n";
  return m;
}

// Reads `want` (whole local shard, or [b, e) of it) and returns the values.
std::vector<float> load(const CheckpointReader& r, const std::string& group, const std::string& name,
                        const ShardSpec& want, int64_t b = 0, int64_t e = -1) {
  if (e < 0) e = want.local_shape().numel();
  std::vector<float> out(size_t(e - b), 0.0f);
  r.read(group, name, want, b, e, Tensor(out.data(), {e - b}, DType::F32));
  return out;
}

std::vector<float> range(const std::vector<float>& v, int64_t b, int64_t e) {
  return std::vector<float>(v.begin() + b, v.begin() + e);
}

// Flips one byte of dataset `dataset`'s stored data, found with H5Dget_offset.
void flip_byte(const std::string& file, const std::string& dataset, int64_t byte) {
  haddr_t offset;
  {
    Hdf5Scope scope;
    H5Id f(XR_HDF5_ID(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)), H5Fclose);
    H5Id d(XR_HDF5_ID(H5Dopen2(f, dataset.c_str(), H5P_DEFAULT)), H5Dclose);
    offset = H5Dget_offset(d);
    ASSERT_NE(offset, HADDR_UNDEF) << dataset << " is not contiguous";
  }
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(std::streamoff(offset + haddr_t(byte)));
  char c;
  io.read(&c, 1);
  c = char(c ^ 0x5a);
  io.seekp(std::streamoff(offset + haddr_t(byte)));
  io.write(&c, 1);
}

std::string error_of(const std::function<void()>& f, ErrorKind kind = ErrorKind::Checkpoint) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

const Shape kW{96, 32};  // the test tensor's global shape

TEST(CheckpointShardMap, MatchesShardSpecAndInverts) {
  const std::vector<ShardSpec> specs = {split(kW, 0, 2, 1),    split(kW, 0, 4, 3),     split(kW, 0, 2, 1, 3),
                                        split(kW, 1, 4, 2),    split({96}, 0, 4, 1, 3), whole(kW),
                                        split(kW, 0, 1, 0, 3)};
  for (const ShardSpec& s : specs) {
    const ShardMap m(s);
    for (int64_t i = 0; i < m.numel(); ++i) {
      const int64_t g = m.to_global(i);
      ASSERT_EQ(g, s.global_index(m.local(), i)) << "dim " << s.dim << " parts " << s.parts << " i " << i;
      ASSERT_EQ(m.to_local(g), i);
      if (m.run_left(i) > 1) {
        ASSERT_EQ(m.to_global(i + 1), g + 1) << "runs are globally contiguous";
      }
    }
  }
  // Every global element belongs to exactly one of the parts; also for rank 3.
  for (const Shape g : {kW, Shape{4, 6, 8}}) {
    for (int dim = 0; dim < g.rank(); ++dim) {
      const int blocks = g[dim] % 6 == 0 ? 3 : 1;
      std::vector<int> owners(size_t(g.numel()), 0);
      for (int p = 0; p < 2; ++p) {
        const ShardMap m(split(g, dim, 2, p, blocks));
        for (int64_t i = 0; i < m.numel(); ++i) ++owners[size_t(m.to_global(i))];
        for (int64_t x = 0; x < g.numel(); ++x)
          if (m.to_local(x) >= 0) {
            ASSERT_EQ(m.to_global(m.to_local(x)), x);
          }
      }
      EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int c) { return c == 1; })) << g.str() << " dim " << dim;
    }
  }
}

// Grouped-query attention's fused QKV: q, k and v blocks of unequal
// extents (64, 16 and 16 rows of 96), each split over the ranks.
ShardSpec gqa(int parts, int index) { return ShardSpec::split_blocks(kW, 0, parts, index, {64, 16, 16}); }

TEST(CheckpointShardMap, UnequalBlocksMatchShardSpecAndTile) {
  for (int parts : {1, 2, 4}) {
    std::vector<int> owners(size_t(kW.numel()), 0);
    for (int p = 0; p < parts; ++p) {
      const ShardSpec s = gqa(parts, p);
      ASSERT_EQ(shard_spec_problem(s), "");
      const ShardMap m(s);
      ASSERT_EQ(m.local(), (Shape{96 / parts, 32}));
      for (int64_t i = 0; i < m.numel(); ++i) {
        const int64_t g = m.to_global(i);
        ASSERT_EQ(g, s.global_index(m.local(), i)) << "parts " << parts << " i " << i;
        ASSERT_EQ(m.to_local(g), i);
        ++owners[size_t(g)];
        if (m.run_left(i) > 1) {
          ASSERT_EQ(m.to_global(i + 1), g + 1) << "runs are globally contiguous";
        }
      }
      // Rank p's first k row is global row 64 + p * 16 / parts.
      const int64_t k_row = 64 / parts;
      EXPECT_EQ(m.to_global(k_row * 32) / 32, 64 + p * (16 / parts)) << "parts " << parts;
    }
    EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int c) { return c == 1; })) << "parts " << parts;
  }
  ShardSpec bad = gqa(2, 0);
  bad.block_sizes = {60, 20, 20};
  EXPECT_NE(shard_spec_problem(bad).find("block sizes add up to 100"), std::string::npos) << shard_spec_problem(bad);
  bad.block_sizes = {63, 17, 16};
  EXPECT_NE(shard_spec_problem(bad).find("not divisible by 2 parts"), std::string::npos) << shard_spec_problem(bad);
}

// Saved in unequal blocks on two ranks, loaded whole, in four shards of
// the same blocks, and as plain row shards.
TEST(CheckpointShardMap, UnequalBlocksRoundTrip) {
  const std::string root = fresh_dir();
  const std::vector<float> W = random_values(kW.numel(), 9);
  CheckpointDir dir(root);
  const std::string tmp = dir.prepare(5);
  for (int rank = 0; rank < 2; ++rank) {
    RankCheckpointWriter w(tmp, rank, 5);
    std::vector<float> local = local_of(W, gqa(2, rank));
    w.add("params", "qkv", gqa(2, rank), view_of(local, gqa(2, rank).local_shape()));
    w.close();
  }
  dir.commit(meta_for(5, 1, 2), 3);
  const CheckpointReader r = CheckpointReader::open_latest(root);
  EXPECT_EQ(r.entries().front().shard.block_sizes, (std::vector<int64_t>{64, 16, 16}));
  EXPECT_EQ(load(r, "params", "qkv", whole(kW)), W);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(load(r, "params", "qkv", gqa(4, i)), local_of(W, gqa(4, i))) << "gqa tp=4 rank " << i;
    EXPECT_EQ(load(r, "params", "qkv", split(kW, 0, 4, i)), local_of(W, split(kW, 0, 4, i))) << "rows rank " << i;
  }
}

TEST(CheckpointCrc, KnownValueAndChaining) {
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(s.data(), s.size()), 0xE3069283u);
  EXPECT_EQ(crc32c(s.data() + 4, 5, crc32c(s.data(), 4)), 0xE3069283u);
}

// Four ranks (dp 2 x tp 2, tp fastest) save one (96, 32) tensor three ways
// (row shards, fused-QKV row shards in 3 blocks, column shards), a (32)
// vector replicated on every rank, and the row tensor's optimizer state as
// ZeRO pieces (each tp shard's flat range split over the two dp ranks).
class CheckpointReshard : public ::testing::Test {
 protected:
  void SetUp() override {
    root = fresh_dir();
    W = random_values(kW.numel(), 1);
    M = random_values(kW.numel(), 2);
    V = random_values(32, 3);
    CheckpointDir dir(root);
    const std::string tmp = dir.prepare(120);
    const int64_t piece_end[2] = {700, 1000};  // uneven ZeRO cuts of the 1536-element shards
    for (int rank = 0; rank < 4; ++rank) {
      const int t = rank % 2, d = rank / 2;
      RankCheckpointWriter w(tmp, rank, 120);
      for (const auto& [name, spec] : {std::pair{"row", split(kW, 0, 2, t)}, std::pair{"qkv", split(kW, 0, 2, t, 3)},
                                       std::pair{"col", split(kW, 1, 2, t)}}) {
        std::vector<float> local = local_of(W, spec);
        w.add("params", name, spec, view_of(local, spec.local_shape()));
      }
      w.add("params", "rep", whole({32}), view_of(V, {32}));
      std::vector<float> m_local = local_of(M, split(kW, 0, 2, t));
      const int64_t b = d == 0 ? 0 : piece_end[t], e = d == 0 ? piece_end[t] : 1536;
      std::vector<float> piece = range(m_local, b, e);
      w.add("adam_m", "row", split(kW, 0, 2, t), b, e, view_of(piece, {e - b}), DType::F32);
      w.close();
    }
    dir.commit(meta_for(120, 2, 2), 3);
  }
  std::string root;
  std::vector<float> W, M, V;
};

TEST_F(CheckpointReshard, AnyLayoutLoadsEveryElement) {
  const CheckpointReader r = CheckpointReader::open_latest(root);
  EXPECT_EQ(r.step(), 120);
  for (const auto& [group, name, G] : {std::tuple{"params", "row", &W}, std::tuple{"params", "qkv", &W},
                                       std::tuple{"params", "col", &W}, std::tuple{"adam_m", "row", &M}}) {
    SCOPED_TRACE(std::string(group) + "/" + name);
    EXPECT_EQ(load(r, group, name, whole(kW)), *G) << "tp=1";
    // tp=4 in every split the model uses, whatever the saved split was.
    for (const auto& [dim, blocks] : {std::pair{0, 1}, std::pair{0, 3}, std::pair{1, 1}})
      for (int i = 0; i < 4; ++i) {
        const ShardSpec want = split(kW, dim, 4, i, blocks);
        EXPECT_EQ(load(r, group, name, want), local_of(*G, want)) << "tp=4 dim " << dim << " blocks " << blocks;
      }
    // ZeRO-like flat pieces of a tp=2 shard (cuts unlike the saved ones).
    for (int t = 0; t < 2; ++t) {
      const ShardSpec want = split(kW, 0, 2, t, 3);
      const std::vector<float> local = local_of(*G, want);
      for (const auto& [b, e] : {std::pair{0, 500}, std::pair{500, 1100}, std::pair{1100, 1536}})
        EXPECT_EQ(load(r, group, name, want, b, e), range(local, b, e)) << "piece [" << b << ", " << e << ")";
    }
  }
  EXPECT_EQ(load(r, "params", "rep", whole({32})), V);
  EXPECT_EQ(load(r, "params", "rep", split({32}, 0, 4, 2)), range(V, 16, 24));
}

TEST_F(CheckpointReshard, IndexDescribesEveryEntry) {
  const CheckpointReader r = CheckpointReader::open(CheckpointDir(root).step_dir(120));
  EXPECT_EQ(r.meta().layout.dp, 2);
  EXPECT_EQ(r.meta().layout.tp, 2);
  EXPECT_EQ(r.meta().config_yaml, "model:\n  n_layer: 2\n");
  EXPECT_EQ(r.meta().rank_files, (std::vector<std::string>{"rank_00000.h5", "rank_00001.h5", "rank_00002.h5", "rank_00003.h5"}));
  EXPECT_EQ(r.entries().size(), 4u * 5u);
  int m_pieces = 0;
  for (const CheckpointEntry& e : r.entries()) {
    EXPECT_EQ(e.dtype, DType::F32);
    EXPECT_TRUE(fs::exists(e.file));
    if (e.group == "adam_m") {
      ++m_pieces;
      EXPECT_EQ(e.dataset, "/adam_m/row@" + std::to_string(e.flat_begin));
      EXPECT_EQ(e.local, (Shape{48, 32}));
    }
    if (e.name == "rep") {
      EXPECT_EQ(e.shard.dim, -1);
    }
  }
  EXPECT_EQ(m_pieces, 4);
  EXPECT_EQ(r.global_shape("params", "qkv"), kW);
  EXPECT_TRUE(r.verify_all().empty());
}

TEST(CheckpointCommit, CrashLeavesPreviousCheckpointAndKeepPrunes) {
  const std::string root = fresh_dir();
  CheckpointDir dir(root);
  auto save = [&](int64_t step, int world, double tag, bool commit) {
    const std::string tmp = dir.prepare(step);
    for (int rank = 0; rank < world; ++rank) {
      RankCheckpointWriter w(tmp, rank, step);
      std::vector<float> v = random_values(32, uint64_t(step * 10 + rank));
      w.add("params", "v", whole({32}), view_of(v, {32}));
      w.set_double("tag", tag);
      w.close();
    }
    if (commit) dir.commit(meta_for(step, world, 1), 2);
  };
  save(10, 2, 1.0, true);
  EXPECT_EQ(dir.latest(), dir.step_dir(10));

  // Step 20 crashes: rank 0 finished, rank 1 left a partial file.
  save(20, 1, 2.0, false);
  { std::ofstream(dir.tmp_dir(20) + "/rank_00001.h5.tmp") << "partial"; }
  const std::string err = error_of([&] { dir.commit(meta_for(20, 2, 1), 2); });
  EXPECT_NE(err.find("rank_00001.h5 is missing"), std::string::npos) << err;
  EXPECT_EQ(dir.latest(), dir.step_dir(10));
  EXPECT_EQ(dir.complete_steps(), std::vector<int64_t>{10});
  const CheckpointReader r10 = CheckpointReader::open_latest(root);
  EXPECT_EQ(r10.step(), 10);
  EXPECT_EQ(r10.get_double(1, "tag"), 1.0);

  // The next commit removes the stale tmp directory; keep=2 prunes step 10 at step 40.
  save(30, 2, 3.0, true);
  EXPECT_FALSE(fs::exists(dir.tmp_dir(20)));
  EXPECT_EQ(dir.complete_steps(), (std::vector<int64_t>{10, 30}));
  save(40, 2, 4.0, true);
  EXPECT_EQ(dir.complete_steps(), (std::vector<int64_t>{30, 40}));
  EXPECT_EQ(dir.latest(), dir.step_dir(40));

  // Re-saving step 40 with a smaller world replaces it whole; stray rank files go.
  const std::string tmp = dir.prepare(40);
  { std::ofstream(tmp + "/rank_00007.h5") << "stray"; }
  RankCheckpointWriter w(tmp, 0, 40);
  w.set_double("tag", 5.0);
  w.close();
  dir.commit(meta_for(40, 1, 1), 2);
  const CheckpointReader r40 = CheckpointReader::open_latest(root);
  EXPECT_EQ(r40.get_double(0, "tag"), 5.0);
  EXPECT_EQ(r40.meta().rank_files.size(), 1u);
  EXPECT_FALSE(fs::exists(dir.step_dir(40) + "/rank_00001.h5"));
  EXPECT_FALSE(fs::exists(dir.step_dir(40) + "/rank_00007.h5"));

  // A damaged `latest` falls back to the newest complete step.
  { std::ofstream(root + "/latest") << "garbage"; }
  EXPECT_EQ(dir.latest(), dir.step_dir(40));
}

TEST(CheckpointCommit, UnclosedWriterLeavesNothing) {
  const std::string root = fresh_dir();
  {
    RankCheckpointWriter w(root, 0, 1);
    std::vector<float> v = random_values(8, 4);
    w.add("params", "v", whole({8}), view_of(v, {8}));
  }  // destroyed without close(): an aborted save
  EXPECT_TRUE(fs::is_empty(root));
}

// Two ranks, tp=2 row shards of "row" and a replicated "rep", 256-element checksum chunks.
std::string save_two_ranks(const std::vector<float>& W, const std::vector<float>& V) {
  const std::string root = fresh_dir();
  CheckpointDir dir(root);
  const std::string tmp = dir.prepare(5);
  for (int rank = 0; rank < 2; ++rank) {
    RankCheckpointWriter w(tmp, rank, 5, {.checksum_chunk = 256});
    std::vector<float> local = local_of(W, split(kW, 0, 2, rank));
    std::vector<float> v = V;
    w.add("params", "row", split(kW, 0, 2, rank), view_of(local, {48, 32}));
    w.add("params", "rep", whole({32}), view_of(v, {32}));
    w.close();
  }
  dir.commit(meta_for(5, 1, 2), 0);
  return dir.step_dir(5);
}

TEST(CheckpointCorruption, FlippedByteNamesTensorAndOnlyOverlappingEntriesAreRead) {
  const std::vector<float> W = random_values(kW.numel(), 5), V = random_values(32, 6);
  const std::string step = save_two_ranks(W, V);
  const std::string file1 = step + "/rank_00001.h5";
  flip_byte(file1, "/params/row", 4 * 1000);  // rank 1's local element 1000: chunk [768, 1024)
  flip_byte(file1, "/params/rep", 4 * 7);     // rank 1's replica only
  const CheckpointReader r = CheckpointReader::open(step);

  const std::string err = error_of([&] { load(r, "params", "row", whole(kW)); });
  EXPECT_NE(err.find("'row'"), std::string::npos) << err;
  EXPECT_NE(err.find("corrupted"), std::string::npos) << err;
  EXPECT_NE(err.find("rank_00001.h5"), std::string::npos) << err;
  // tp=4 shards 0 and 1 lie in rank 0's entry; shard 2 reads rank 1's chunks
  // [0, 768) only; shard 3 needs the damaged chunk.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(load(r, "params", "row", split(kW, 0, 4, i)), local_of(W, split(kW, 0, 4, i)));
  EXPECT_NE(error_of([&] { load(r, "params", "row", split(kW, 0, 4, 3)); }).find("corrupted"), std::string::npos);
  // The replicated vector is read from rank 0 alone.
  EXPECT_EQ(load(r, "params", "rep", whole({32})), V);

  const std::vector<std::string> problems = r.verify_all();
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_NE(problems[0].find("'rep'"), std::string::npos) << problems[0];
  EXPECT_NE(problems[1].find("'row'"), std::string::npos) << problems[1];
}

TEST(CheckpointCorruption, TruncatedOrMissingFilesAreClearErrors) {
  const std::vector<float> W = random_values(kW.numel(), 7), V = random_values(32, 8);
  const std::string step = save_two_ranks(W, V);
  const std::string file1 = step + "/rank_00001.h5";
  fs::resize_file(file1, fs::file_size(file1) / 2);
  std::string err = error_of([&] { CheckpointReader::open(step); });
  EXPECT_NE(err.find("rank_00001.h5"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;

  fs::remove(file1);
  err = error_of([&] { CheckpointReader::open(step); });
  EXPECT_NE(err.find("rank_00001.h5"), std::string::npos) << err;
  EXPECT_NE(err.find("missing"), std::string::npos) << err;

  fs::remove(step + "/meta.json");
  err = error_of([&] { CheckpointReader::open(step); });
  EXPECT_NE(err.find("not a complete checkpoint"), std::string::npos) << err;
}

// Numbers in meta.json that no layout has: a float, a value past int, a
// string, a negative step. Each is one line naming the field; none reaches a
// conversion (undefined for out-of-range floats).
TEST(CheckpointErrors, MetaNumbersOutOfRangeAreRefused) {
  const std::vector<float> W = random_values(kW.numel(), 7), V = random_values(32, 8);
  const std::string step = save_two_ranks(W, V);
  const std::string meta = step + "/meta.json";
  nlohmann::json good;
  std::ifstream(meta) >> good;
  auto with = [&](const std::string& where, const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = good;
    (where.empty() ? j : j[where])[key] = value;
    std::ofstream(meta) << j.dump();
    return error_of([&] { CheckpointReader::open(step); });
  };
  std::string err = with("layout", "virtual_stages", 4.4e105);
  EXPECT_NE(err.find("'virtual_stages' is 4.4e+105 (expected an integer in 1..16777216)"), std::string::npos) << err;
  err = with("layout", "dp", int64_t(1) << 40);
  EXPECT_NE(err.find("'dp' is 1099511627776 (expected an integer in 1..16777216)"), std::string::npos) << err;
  err = with("layout", "tp", "2");
  EXPECT_NE(err.find("'tp' is \"2\""), std::string::npos) << err;
  err = with("", "step", -3);
  EXPECT_NE(err.find("'step' is -3"), std::string::npos) << err;
  err = with("", "format_version", 99);
  EXPECT_NE(err.find("format_version 99 is not supported"), std::string::npos) << err;
  std::ofstream(meta) << good.dump();
  EXPECT_NO_THROW(CheckpointReader::open(step)) << "the untouched meta.json reads";
}

TEST(CheckpointErrors, GlobalShapeMismatch) {
  const std::string root = fresh_dir();
  CheckpointDir dir(root);
  std::vector<float> big = random_values(192 * 64, 9);
  {
    RankCheckpointWriter w(dir.prepare(1), 0, 1);
    w.add("params", "h.0.attn.c_attn.weight", whole({192, 64}), view_of(big, {192, 64}));
    w.close();
  }
  dir.commit(meta_for(1, 1, 1), 0);
  const CheckpointReader r = CheckpointReader::open_latest(root);
  EXPECT_EQ(error_of([&] { load(r, "params", "h.0.attn.c_attn.weight", split(kW, 0, 2, 0, 3)); }),
            "checkpoint tensor 'h.0.attn.c_attn.weight' has global shape (192, 64), the model expects (96, 32)");
  EXPECT_NE(error_of([&] { load(r, "params", "h.1.attn.c_attn.weight", whole(kW)); }).find("has no tensor"),
            std::string::npos);
}

// Replaces attribute `name` of dataset `dataset` in `file` with int64 values.
void set_attr_i64s(const std::string& file, const std::string& dataset, const char* name,
                   const std::vector<int64_t>& values) {
  Hdf5Scope scope;
  H5Id f(XR_HDF5_ID(H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT)), H5Fclose);
  H5Id d(XR_HDF5_ID(H5Dopen2(f, dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  XR_HDF5_CHECK(H5Adelete(d, name));
  if (values.size() == 1) write_attr_i64(d, name, values[0]);
  else write_attr_i64s(d, name, values);
  d.close();
  f.close();
}

// Entry attributes that a damaged or hostile file may hold, each refused at
// open with one line naming the file, the entry and what was expected
// (inputs of the hdf5_attrs fuzz target, tests/fuzz).
TEST(CheckpointErrors, HostileEntryAttributesAreRefusedWithOneLine) {
  const std::vector<float> W = random_values(kW.numel(), 11), V = random_values(32, 12);
  const int64_t big = int64_t(1) << 40;
  struct Case {
    const char* dataset;
    const char* attr;
    std::vector<int64_t> values;
    std::string expected;
  };
  const std::vector<Case> cases = {
      // 2^32 + 2 parts: narrowed to an int it read as 2, a plausible split of another tensor.
      {"/params/row", "parts", {(int64_t(1) << 32) + 2}, "attribute 'parts' is 4294967298 (expected 1..2147483647)"},
      {"/params/row", "split_dim", {-(int64_t(1) << 32)}, "attribute 'split_dim' is -4294967296 (expected -1..2147483647)"},
      // A chunk so large that rounding the element count up to it overflowed.
      {"/params/row", "checksum_chunk", {INT64_MAX},
       "checksum chunks disagree with the extent: 6 checksums of chunks of 9223372036854775807 elements for 1536 elements"},
      // 2^80 elements: the element count overflowed (to 0), before any range check.
      {"/params/rep", "global_shape", {big, big}, "global shape (1099511627776, 1099511627776) has more elements than a 64-bit count holds"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.attr);
    const std::string step = save_two_ranks(W, V);
    set_attr_i64s(step + "/rank_00000.h5", c.dataset, c.attr, c.values);
    const std::string err = error_of([&] { CheckpointReader::open(step); });
    EXPECT_NE(err.find("rank_00000.h5 entry " + std::string(c.dataset)), std::string::npos) << err;
    EXPECT_NE(err.find(c.expected), std::string::npos) << err;
  }
}

TEST(CheckpointErrors, MissingElementIsNamed) {
  const std::string root = fresh_dir();
  CheckpointDir dir(root);
  const std::vector<float> W = random_values(kW.numel(), 10);
  const std::string tmp = dir.prepare(1);
  for (int rank = 0; rank < 2; ++rank) {
    RankCheckpointWriter w(tmp, rank, 1);
    std::vector<float> local = local_of(W, split(kW, 0, 2, 0));
    if (rank == 0) w.add("params", "row", split(kW, 0, 2, 0), view_of(local, {48, 32}));  // rank 1 forgot its shard
    w.close();
  }
  dir.commit(meta_for(1, 1, 2), 0);
  const CheckpointReader r = CheckpointReader::open_latest(root);
  EXPECT_EQ(load(r, "params", "row", split(kW, 0, 2, 0)), local_of(W, split(kW, 0, 2, 0)));
  const std::string err = error_of([&] { load(r, "params", "row", whole(kW)); });
  EXPECT_NE(err.find("'row'"), std::string::npos) << err;
  EXPECT_NE(err.find("missing global element 1536 (48, 0)"), std::string::npos) << err;
}

TEST(CheckpointDtype, Bf16StorageRoundTrip) {
  const std::string root = fresh_dir();
  CheckpointDir dir(root);
  const std::vector<float> W = random_values(kW.numel(), 11);
  std::vector<double> D(W.begin(), W.end());
  for (auto& x : D) x += 1e-9;  // not representable in f32
  const std::string tmp = dir.prepare(1);
  for (int rank = 0; rank < 2; ++rank) {
    RankCheckpointWriter w(tmp, rank, 1);
    std::vector<float> local = local_of(W, split(kW, 0, 2, rank));
    w.add("params", "w", split(kW, 0, 2, rank), 0, 1536, view_of(local, {48, 32}), DType::BF16);
    if (rank == 0) w.add("params", "d", whole(kW), 0, kW.numel(), Tensor(D.data(), kW, DType::F64), DType::F32);
    w.close();
  }
  dir.commit(meta_for(1, 1, 2), 0);
  const CheckpointReader r = CheckpointReader::open_latest(root);
  for (const CheckpointEntry& e : r.entries()) EXPECT_EQ(e.dtype, e.name == "w" ? DType::BF16 : DType::F32);
  const std::vector<float> got = load(r, "params", "w", whole(kW));
  std::vector<bf16> bits(size_t(kW.numel()));
  r.read("params", "w", whole(kW), Tensor(bits.data(), kW, DType::BF16));
  for (size_t i = 0; i < W.size(); ++i) {
    ASSERT_EQ(got[i], bf16_to_float(float_to_bf16(W[i]))) << i;
    ASSERT_EQ(bits[i].bits, float_to_bf16(W[i]).bits) << i;
  }
  std::vector<double> d(D.size());
  r.read("params", "d", whole(kW), Tensor(d.data(), kW, DType::F64));
  for (size_t i = 0; i < D.size(); ++i) ASSERT_EQ(d[i], double(float(D[i]))) << i;
}

TEST(CheckpointScalars, RoundTripPerRank) {
  const std::string root = fresh_dir();
  CheckpointDir dir(root);
  const std::string tmp = dir.prepare(7);
  for (int rank = 0; rank < 2; ++rank) {
    RankCheckpointWriter w(tmp, rank, 7);
    w.set_int("data.position", 1000 + rank);
    w.set_int("rng.offset", int64_t(1) << 40);
    w.set_double("loss_scale", 65536.0);
    w.set_double("loss_scale", 32768.0 / (rank + 1));  // the last value wins
    w.close();
  }
  dir.commit(meta_for(7, 2, 1), 0);
  const CheckpointReader r = CheckpointReader::open_latest(root);
  EXPECT_EQ(r.get_int(1, "data.position"), 1001);
  EXPECT_EQ(r.get_int(0, "rng.offset"), int64_t(1) << 40);
  EXPECT_EQ(r.get_double(1, "loss_scale"), 16384.0);
  EXPECT_TRUE(r.has_scalar(0, "loss_scale"));
  EXPECT_FALSE(r.has_scalar(0, "missing"));
  EXPECT_NE(error_of([&] { r.get_int(0, "loss_scale"); }).find("no integer scalar 'loss_scale'"), std::string::npos);
}

TEST(CheckpointHdf5, CheckCarriesHdf5Message) {
  Hdf5Scope scope;
  const std::string err = error_of(
      [] { H5Id f(XR_HDF5_ID(H5Fopen("/nonexistent/x.h5", H5F_ACC_RDONLY, H5P_DEFAULT)), H5Fclose); },
      ErrorKind::Library);
  EXPECT_NE(err.find("H5Fopen"), std::string::npos) << err;
  EXPECT_NE(err.find("unable to open file"), std::string::npos) << err;
}

}  // namespace
}  // namespace xirang
