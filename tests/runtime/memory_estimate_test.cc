// The memory estimate (runtime/memory_estimate.h) against the trainer's own
// memory plan: the same categories and bytes for single-rank configs, and
// layout-only shards that add up for tensor- and pipeline-parallel layouts.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/config/model_layout.h"
#include "runtime/data/dataset.h"
#include "runtime/memory_estimate.h"
#include "runtime/trainer.h"
#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

std::string tiny_dataset() {
  static const std::string dir = [] {
    const fs::path out = fs::path(::testing::TempDir()) / ("xirang_memest_" + std::to_string(::getpid())) / "train";
    testing_util::temp_dirs->paths.push_back(out.parent_path().string());
    fs::remove_all(out);
    DatasetWriter w(out.string(), "bytes", 256, -1);
    std::vector<int32_t> ids(20000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919) % 256);
    w.add_document(ids.data(), ids.size());
    w.finish();
    return out.string();
  }();
  return dir;
}

Config debug_config(std::vector<std::string> overrides, int world = 1) {
  overrides.insert(overrides.begin(), "data.train=" + tiny_dataset());
  Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/gpt2_debug.yaml", overrides);
  validate(c, world);
  return c;
}

// A pipeline-only layout of configs/<file>.yaml with m = 3p microbatches
// (micro_batch 1) under 1f1b or zb_h1.
Config pipeline_config(const std::string& file, int pp, bool zb_h1, std::vector<std::string> extra) {
  extra.insert(extra.begin(), "data.train=" + tiny_dataset());
  extra.insert(extra.end(), {"parallel.pp=" + std::to_string(pp), "parallel.dp=1", "train.micro_batch=1",
                             "train.global_batch=" + std::to_string(3 * pp),
                             std::string("parallel.schedule=") + (zb_h1 ? "zb_h1" : "1f1b")});
  Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/" + file + ".yaml", extra);
  validate(c, pp);
  return c;
}

std::string mib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", double(bytes) / (1 << 20));
  return buf;
}

void expect_same_plan(const MemoryPlan& want, const MemoryPlan& got) {
  for (const auto& item : want.items()) {
    if (item.category == "checkpoint snapshot") continue;
    EXPECT_EQ(got.bytes_of(item.category), item.bytes) << item.category;
  }
  for (const auto& item : got.items()) EXPECT_GT(want.bytes_of(item.category), 0u) << item.category;
}

class MemoryEstimateMatchesTrainer : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(MemoryEstimateMatchesTrainer, SameBytesPerCategory) {
  const Config cfg = debug_config(GetParam());
  TrainerOptions opts;
  opts.print = false;
  opts.peak = PeakFlops{1e11, "test"};
  Trainer trainer(cfg, opts);
  expect_same_plan(trainer.memory_plan(), estimate_memory(cfg));
}

INSTANTIATE_TEST_SUITE_P(
    SingleRank, MemoryEstimateMatchesTrainer,
    ::testing::Values(std::vector<std::string>{}, std::vector<std::string>{"train.micro_batch=4"},
                      std::vector<std::string>{"precision.dtype=bf16", "train.micro_batch=2"},
                      std::vector<std::string>{"parallel.zero=1", "parallel.bucket_mb=0.01"},
                      std::vector<std::string>{"precision.dtype=fp16", "parallel.zero=1", "parallel.bucket_mb=0.02",
                                               "model.d_model=128"},
                      std::vector<std::string>{"train.recompute=selective", "train.micro_batch=2"},
                      std::vector<std::string>{"train.recompute=full", "precision.dtype=bf16"},
                      std::vector<std::string>{"train.recompute=selective", "precision.dtype=bf16"}));

// Activation bytes per microbatch (activation_split's per_slot) of `file`
// under each train.recompute mode, and per layer (the difference between
// n_layer and one layer), printed next to Korthikanti et al.'s
// s b h (34 + 5 a s / h) bytes per layer (16-bit activations, attention
// scores kept): the numbers of docs/performance.md.
std::vector<size_t> recompute_table(const std::string& file, std::vector<std::string> overrides) {
  overrides.push_back("parallel.dp=1");
  const Config base = load_config(std::string(XIRANG_SOURCE_DIR) + "/" + file, overrides);
  const double s = base.seq_len(), b = base.train.micro_batch, h = base.model.d_model, a = base.model.n_head;
  const int L = base.model.n_layer;
  std::printf("%s, micro_batch %d x %d, %s, %d layers; formula per layer: %.1f MiB\n", file.c_str(), int(b), int(s),
              config_name(base.precision.dtype), L, s * b * h * (34 + 5 * a * s / h) / (1 << 20));
  std::vector<size_t> per_slot;
  for (const char* mode : {"none", "selective", "full"}) {
    auto split = [&](int layers) {
      std::vector<std::string> o = overrides;
      o.push_back(std::string("train.recompute=") + mode);
      o.push_back("model.n_layer=" + std::to_string(layers));
      return activation_split(load_config(std::string(XIRANG_SOURCE_DIR) + "/" + file, o));
    };
    const ActivationSplit all = split(L), one = split(1);
    per_slot.push_back(all.per_slot);
    std::printf("  %-9s per microbatch %9.1f MiB, per layer %8.1f MiB, fixed %8.1f MiB\n", mode,
                double(all.per_slot) / (1 << 20), double(all.per_slot - one.per_slot) / (L - 1) / (1 << 20),
                double(all.fixed) / (1 << 20));
  }
  return per_slot;
}

// Activation recomputation, measured by the arena accounting without
// allocating: GPT-2 124M at micro_batch 8 x 1024 keeps at least 3x fewer
// activation bytes per microbatch with full recomputation than without.
TEST(MemoryEstimate, FullRecomputationCutsGpt2ActivationsThreefold) {
  const std::vector<size_t> m = recompute_table("configs/gpt2_124m.yaml", {"train.micro_batch=8"});
  EXPECT_GE(m[0], 3 * m[2]) << "none " << m[0] << ", full " << m[2];
  EXPECT_LT(m[1], m[0]);
  EXPECT_GT(m[1], m[2]);
  const std::vector<size_t> bf16 =
      recompute_table("configs/gpt2_124m.yaml", {"train.micro_batch=8", "precision.dtype=bf16"});
  EXPECT_GE(bf16[0], 3 * bf16[2]);
  // LLaMA 3 8B, one sequence of 8192 tokens: layout only.
  const std::vector<size_t> llama = recompute_table("configs/llama3_8b.yaml", {"train.micro_batch=1"});
  EXPECT_GE(llama[0], 3 * llama[2]);
  EXPECT_LT(llama[1], llama[0]);
}

// Tensor-parallel shards: each rank holds 1/tp of the split matrices; the
// whole model's parameters over the shards equal the single-rank count
// plus the replicated tensors (norms, row-parallel biases, positions) tp-1 times more.
TEST(MemoryEstimate, TensorParallelShardsAreSmaller) {
  const Config one = debug_config({});
  const Config two = debug_config({"parallel.tp=2", "parallel.dp=1"}, 2);
  const size_t p1 = estimate_memory(one).bytes_of("parameters");
  const size_t p2a = estimate_memory(two, {0, 0, 0}).bytes_of("parameters");
  const size_t p2b = estimate_memory(two, {0, 1, 0}).bytes_of("parameters");
  EXPECT_EQ(p2a, p2b);
  EXPECT_LT(p2a, p1 * 6 / 10);
  EXPECT_GT(p2a, p1 * 4 / 10);
}

// Context parallelism: a cp rank's input batch holds its T / cp rows of each
// sequence, and ZeRO-1 shards over dp x cp, so a dp 2 x cp 2 rank holds the
// shard of the dp 4 rank at its place in the dp x cp group. (The chunks'
// own activations fall with cp once the model side lays out its rows.)
TEST(MemoryEstimate, ContextParallelRowsAndShards) {
  const Config one = debug_config({"parallel.zero=1"});
  const Config cp2 = debug_config({"parallel.zero=1", "parallel.cp=2"}, 2);
  const size_t B = 1, T = 64;
  ASSERT_EQ(size_t(one.seq_len()), T);
  EXPECT_EQ(estimate_memory(one).bytes_of("input batch"), 2 * B * T * 4 + 2 * Arena::kAlignment);
  EXPECT_EQ(estimate_memory(cp2).bytes_of("input batch"), 2 * B * (T / 2) * 4 + 2 * Arena::kAlignment);
  const Config dp4 = debug_config({"parallel.zero=1", "parallel.dp=4"}, 4);
  const Config dp2cp2 = debug_config({"parallel.zero=1", "parallel.dp=2", "parallel.cp=2"}, 4);
  const size_t whole = estimate_memory(one).bytes_of("gradient shard");
  for (int d = 0; d < 2; ++d)
    for (int k = 0; k < 2; ++k) {
      SCOPED_TRACE(str_cat("dp rank ", d, " cp rank ", k));
      const MemoryPlan got = estimate_memory(dp2cp2, {0, 0, d, k});
      const MemoryPlan want = estimate_memory(dp4, {0, 0, 2 * d + k});
      EXPECT_EQ(got.bytes_of("gradient shard"), want.bytes_of("gradient shard"));
      EXPECT_EQ(got.bytes_of("optimizer state"), want.bytes_of("optimizer state"));
      EXPECT_LT(got.bytes_of("gradient shard"), whole * 4 / 10);
    }
}

// Pipeline stages: the first keeps more microbatches in flight under 1F1B.
TEST(MemoryEstimate, FirstStageHoldsMoreActivations) {
  const Config c = debug_config({"parallel.pp=4", "parallel.dp=1"}, 4);
  EXPECT_GT(estimate_memory(c, {0, 0, 0}).bytes_of("activations"), estimate_memory(c, {3, 0, 0}).bytes_of("activations"));
  int rank = -1;
  estimate_peak_memory(c, &rank);
  EXPECT_TRUE(rank == 0 || rank == 3);
}

// ZB-H1 frees a microbatch's activation slot at its input part, as 1F1B
// frees it at its backward; what the weight part needs lives in input and
// weight slots of their own, as many as the schedule holds at once
// (slot_counts). The most activation bytes any pipeline rank plans are
// within 7% of 1F1B's, without recomputation: the zero-bubble bench's
// config (gpt2_debug at d_model 256, seq_len 128, micro_batch 2, m = 3p,
// pp 2) and gpt2_debug and llama_debug at pp 2 and 4.
TEST(MemoryEstimate, ZeroBubbleH1ActivationsWithinSevenPercentOfOneFOneB) {
  struct Case {
    std::string file;
    std::vector<std::string> overrides;
  };
  const std::vector<Case> cases = {
      {"gpt2_debug", {"model.d_model=256", "model.seq_len=128", "train.micro_batch=2", "train.global_batch=12",
                      "parallel.pp=2"}},
      {"gpt2_debug", {"parallel.pp=2"}},
      {"gpt2_debug", {"parallel.pp=4"}},
      {"llama_debug", {"parallel.pp=2"}},
      {"llama_debug", {"parallel.pp=4"}},
  };
  for (const Case& c : cases) {
    size_t most[2] = {0, 0};
    int pp = 0;
    for (int k = 0; k < 2; ++k) {
      std::vector<std::string> o = c.overrides;
      o.insert(o.begin(), "data.train=" + tiny_dataset());
      o.push_back(k == 0 ? "parallel.schedule=1f1b" : "parallel.schedule=zb_h1");
      o.push_back("parallel.dp=1");
      Config cfg = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/" + c.file + ".yaml", o);
      pp = cfg.parallel.pp;
      validate(cfg, pp);
      for (int r = 0; r < pp; ++r) most[k] = std::max(most[k], estimate_memory(cfg, {r, 0, 0}).bytes_of("activations"));
    }
    const double ratio = double(most[1]) / double(most[0]);
    std::printf("%s pp=%d %s: activations 1f1b %.2f MiB, zb_h1 %.2f MiB (%.3fx)\n", c.file.c_str(), pp,
                c.overrides.size() > 1 ? "(zero-bubble bench)" : "", double(most[0]) / (1 << 20),
                double(most[1]) / (1 << 20), ratio);
    EXPECT_LE(ratio, 1.07) << c.file << " pp=" << pp;
  }
}

// A trillion-parameter layout is measured, not allocated: fast, and the
// bytes are those of 1/(tp x pp) of the model.
TEST(MemoryEstimate, HugeModelIsFastAndAllocatesNothing) {
  Config c = debug_config({"model.n_layer=128", "model.d_model=25600", "model.n_head=160", "model.seq_len=2048",
                           "model.vocab_size=51200", "parallel.tp=8", "parallel.pp=64", "parallel.dp=6",
                           "train.global_batch=3072", "train.micro_batch=1", "precision.dtype=fp16"},
                          3072);
  auto peak_rss_kb = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return long(u.ru_maxrss);
  };
  const long rss0 = peak_rss_kb();
  const auto t0 = std::chrono::steady_clock::now();
  const MemoryPlan plan = estimate_memory(c, {0, 0, 0});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 2.0);
  EXPECT_LT(peak_rss_kb() - rss0, 64 * 1024) << "the estimate touched more than 64 MiB";
  const double params = double(plan.bytes_of("parameters")) / 2;  // fp16
  EXPECT_GT(params, 1.0e12 / 512 * 0.9);
  EXPECT_LT(params, 1.0e12 / 512 * 1.3);
}

// At m = 3p microbatches, every pipeline rank's
// activations under both schedules, gpt2_debug and llama_debug at pp 2 and
// 4 in fp32 and bf16, no recomputation. Rank r of p holds 1F1B's p - r
// (+2 posted ahead) activation slots, p input slots and r + 1 weight
// slots, so the later ranks plan more than under 1F1B, but no rank more
// than 7% above 1F1B's most (its first rank's).
TEST(MemoryEstimate, ZeroBubbleH1PeakActivationsAtThreeMicrobatchesPerStage) {
  for (const char* file : {"gpt2_debug", "llama_debug"})
    for (const char* dtype : {"fp32", "bf16"})
      for (int pp : {2, 4}) {
        size_t most[2] = {0, 0};
        std::string per_rank;
        for (int r = 0; r < pp; ++r) {
          size_t bytes[2];
          for (int k = 0; k < 2; ++k) {
            const Config cfg = pipeline_config(file, pp, k == 1, {std::string("precision.dtype=") + dtype});
            bytes[k] = estimate_memory(cfg, {r, 0, 0}).bytes_of("activations");
            most[k] = std::max(most[k], bytes[k]);
          }
          per_rank += str_cat(" r", r, " ", mib(bytes[0]), "/", mib(bytes[1]));
        }
        const double ratio = double(most[1]) / double(most[0]);
        std::printf("%s %s pp=%d m=%d: peak activations 1f1b %s, zb_h1 %s MiB (%.3fx); per rank 1f1b/zb_h1:%s\n", file,
                    dtype, pp, 3 * pp, mib(most[0]).c_str(), mib(most[1]).c_str(), ratio, per_rank.c_str());
        EXPECT_LE(ratio, 1.07) << file << " " << dtype << " pp=" << pp;
      }
}

// What one microbatch keeps in each pool, measured on a middle chunk of
// gpt2_debug (2 layers, N = 64 rows, C = 64, fp32) by laying out one more
// slot of a pool. Without recomputation the activation and input slots
// split 1F1B's slot (nothing kept twice) and a weight slot holds the four
// weight products' output gradients, N (3C + C + 4C + C) floats a layer.
// With full recomputation that weight slot alone is several times 1F1B's
// slot (which keeps each layer's input): deferring W costs memory that no
// pool can avoid, which is why the 7% bound holds without recomputation only.
TEST(MemoryEstimate, ZeroBubbleH1PoolsPerMicrobatch) {
  auto pools = [](const std::vector<std::string>& extra) {
    const Config zb = pipeline_config("gpt2_debug", 4, true, extra), one = pipeline_config("gpt2_debug", 4, false, extra);
    auto measure = [](const Config& cfg, int a, int i, int w) {
      auto c = model_arch(cfg.model.arch)
                   .make_chunk(cfg.model, ChunkPlacement::of_chunk(cfg.model.n_layer, 4, 1), DType::F32,
                               chunk_batch(cfg, a, i, w), TensorParallel{});
      Arena arena = Arena::measuring("activations");
      c->layout_activations(arena);
      return int64_t(arena.used());
    };
    const int64_t base = measure(zb, 1, 1, 1);
    struct {
      int64_t one_f_one_b, activation, input, weight;
    } b{measure(one, 2, 0, 0) - measure(one, 1, 0, 0), measure(zb, 2, 1, 1) - base, measure(zb, 1, 2, 1) - base,
        measure(zb, 1, 1, 2) - base};
    return b;
  };
  const int64_t N = 64, C = 64, layers = 2, f32 = 4;
  const auto none = pools({});
  EXPECT_EQ(none.activation + none.input, none.one_f_one_b);
  EXPECT_EQ(none.weight, layers * N * (3 * C + C + 4 * C + C) * f32);
  const auto full = pools({"train.recompute=full"});
  EXPECT_GT(full.weight, 8 * full.one_f_one_b);
  std::printf("per microbatch (bytes): no recomputation 1f1b slot %lld, zb_h1 activation %lld + input %lld + weight %lld; "
              "full recomputation 1f1b slot %lld, zb_h1 weight %lld\n",
              (long long)none.one_f_one_b, (long long)none.activation, (long long)none.input, (long long)none.weight,
              (long long)full.one_f_one_b, (long long)full.weight);
}

}  // namespace
}  // namespace xirang
