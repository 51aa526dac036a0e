// ConfigValidate: the rules between fields (runtime/config/validate.cc),
// presets, and the shipped configs, each error one line naming key, value
// and rule.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/config/config.h"
#include "runtime/config/schedule_rules.h"
#include "tests/runtime/config_errors.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

class ConfigValidate : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            ("xirang_config_test_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(root_ / "train");
    fs::create_directories(root_ / "val");
    fs::create_directories(root_ / "empty");
    std::ofstream(root_ / "train" / "index.json") << "{}";
    std::ofstream(root_ / "val" / "index.json") << "{}";
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string dir(const char* name) const { return (root_ / name).string(); }

  // A valid debug-sized config (world 1) plus `overrides`.
  Config base(std::vector<std::string> overrides = {}) const {
    std::vector<std::string> all = {"data.train=" + dir("train"), "data.val=" + dir("val")};
    all.insert(all.end(), overrides.begin(), overrides.end());
    return parse_config(
        "model: {n_layer: 8, n_head: 4, d_model: 64, seq_len: 64, vocab_size: 256}\n"
        "train: {steps: 10, global_batch: 8, micro_batch: 1, eval_every: 5}\n",
        all, "v.yaml");
  }

  void expect_invalid(std::vector<std::string> overrides, int world, const std::vector<std::string>& needles) {
    SCOPED_TRACE(::testing::PrintToString(overrides) + " world " + std::to_string(world));
    Config c = base(overrides);
    expect_config_error([&] { validate(c, world); }, needles);
  }

  fs::path root_;
};

TEST_F(ConfigValidate, ValidConfigPasses) {
  Config c = base();
  validate(c, 1);
  Config observed = base({"metrics.prometheus=127.0.0.1:9400", "metrics.straggler_every=5", "metrics.job=run7",
                          "faults.kind=slow_rank", "faults.step=2", "faults.delay_ms=40"});
  validate(observed, 1);
  EXPECT_EQ(observed.metrics.prometheus, "127.0.0.1:9400");
  EXPECT_EQ(observed.faults.kind, FaultKind::SlowRank);
  EXPECT_EQ(observed.faults.delay_ms, 40);
  EXPECT_EQ(c.parallel.dp, 1);
  EXPECT_EQ(c.microbatches(), 8);
  EXPECT_EQ(c.seq_len(), 64);
}

TEST_F(ConfigValidate, InfersDataParallelSize) {
  Config c = base({"parallel.tp=2", "parallel.pp=2"});
  validate(c, 8);
  EXPECT_EQ(c.parallel.dp, 2);
  EXPECT_EQ(c.microbatches(), 4);

  Config explicit_dp = base({"parallel.dp=4"});
  validate(explicit_dp, 4);
  EXPECT_EQ(explicit_dp.parallel.dp, 4);

  expect_invalid({"parallel.tp=2"}, 3, {"world size 3", "parallel.tp (2)", "parallel.pp (1)", "not divisible"});
  expect_invalid({"parallel.dp=1", "parallel.tp=2"}, 3,
                 {"world size 3 != parallel.dp (1) x parallel.tp (2) x parallel.pp (1)"});
  expect_invalid({}, 0, {"world size 0"});
}

// Context parallelism: cp ranks count in the world (dp is what is left),
// and each sequence must cut into 2 x cp equal chunks.
TEST_F(ConfigValidate, ContextParallelRules) {
  Config c = base({"parallel.cp=2", "parallel.tp=2"});
  EXPECT_EQ(c.parallel.cp_split, CpSplit::HeadTail);  // the default: causal work balanced
  validate(c, 8);
  EXPECT_EQ(c.parallel.dp, 2);
  EXPECT_EQ(c.microbatches(), 4);  // cp ranks share their dp rank's samples
  Config contiguous = base({"parallel.cp=4", "parallel.cp_split=contiguous", "train.seq_len=40"});
  validate(contiguous, 4);
  EXPECT_EQ(contiguous.parallel.dp, 1);
  EXPECT_EQ(contiguous.parallel.cp_split, CpSplit::Contiguous);
  Config odd = base({"train.seq_len=33"});  // cp = 1 cuts nothing
  EXPECT_NO_THROW(validate(odd, 1));

  expect_invalid({"parallel.cp=0"}, 1, {"parallel.cp=0 must be >= 1"});
  expect_config_error([&] { base({"parallel.cp_split=ring"}); }, {"parallel.cp_split='ring'", "head_tail, contiguous"});
  EXPECT_EQ(c.parallel.cp_comm, CpCommKind::AllGather);  // the default: the exchange Llama 3 chose
  Config ring = base({"parallel.cp=2", "parallel.cp_comm=ring"});
  validate(ring, 2);
  EXPECT_EQ(ring.parallel.cp_comm, CpCommKind::Ring);
  expect_config_error([&] { base({"parallel.cp_comm=p2p"}); }, {"parallel.cp_comm='p2p'", "all_gather, ring"});
  expect_invalid({"parallel.cp=2", "parallel.cp_comm=ring", "device.backend=cuda"}, 2,
                 {"parallel.cp_comm=ring runs on the CPU backend only"});
  expect_invalid({"parallel.cp=4"}, 6,
                 {"world size 6 is not divisible by parallel.cp (4) x parallel.tp (1) x parallel.pp (1) = 4"});
  expect_invalid({"parallel.dp=2", "parallel.cp=2"}, 2,
                 {"world size 2 != parallel.dp (2) x parallel.cp (2) x parallel.tp (1) x parallel.pp (1)"});
  // 36 splits into 4 chunks (cp 2) and over 4 ranks, but not into 8 chunks.
  Config halves = base({"parallel.cp=2", "train.seq_len=36"});
  EXPECT_NO_THROW(validate(halves, 2));
  expect_invalid({"parallel.cp=4", "train.seq_len=36"}, 4,
                 {"train.seq_len=36 is not divisible by 2 x parallel.cp (4) = 8"});
  expect_invalid({"parallel.cp=4", "train.seq_len=0", "model.seq_len=60"}, 4,
                 {"model.seq_len=60 is not divisible by 2 x parallel.cp (4) = 8"});
  // Sequence parallelism splits a cp rank's rows: 48 rows split over tp 16, a cp rank's 24 do not.
  Config sp = base({"model.n_head=16", "train.seq_len=48", "parallel.tp=16", "parallel.sequence_parallel=true"});
  EXPECT_NO_THROW(validate(sp, 16));
  expect_invalid({"model.n_head=16", "train.seq_len=48", "parallel.tp=16", "parallel.sequence_parallel=true",
                  "parallel.cp=2"},
                 32, {"splits the 24 token rows", "/ parallel.cp 2", "parallel.tp=16"});
}

// Expert parallelism lives inside dp: it must divide dp (inferred or given)
// and adds no ranks to the world.
TEST_F(ConfigValidate, ExpertParallelDividesDp) {
  Config none = base({});
  EXPECT_EQ(none.parallel.ep, 1);  // the default: no expert parallelism
  Config c = base({"parallel.ep=2", "parallel.tp=2"});
  validate(c, 8);
  EXPECT_EQ(c.parallel.dp, 4);
  EXPECT_EQ(c.parallel.ep, 2);
  Config all = base({"parallel.ep=4"});
  EXPECT_NO_THROW(validate(all, 4));
  expect_invalid({"parallel.ep=0"}, 4, {"parallel.ep=0 must be >= 1"});
  expect_invalid({"parallel.ep=3"}, 4,
                 {"parallel.ep=3 does not divide parallel.dp=4: expert parallelism shards the experts"});
  expect_invalid({"parallel.ep=4", "parallel.cp=2"}, 4, {"parallel.ep=4 does not divide parallel.dp=2"});
}

TEST_F(ConfigValidate, EachRuleNamesKeyValueAndRule) {
  struct Case {
    std::vector<std::string> overrides;
    int world;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {{"model.arch=bert"}, 1, {"model.arch='bert'", "gpt2, llama"}},
      {{"model.n_layer=0"}, 1, {"model.n_layer=0 must be >= 1"}},
      {{"model.n_head=0"}, 1, {"model.n_head=0 must be >= 1"}},
      {{"model.d_model=-64"}, 1, {"model.d_model=-64 must be >= 1"}},
      {{"model.seq_len=0", "train.seq_len=0"}, 1, {"model.seq_len=0 must be >= 1"}},
      {{"model.vocab_size=0"}, 1, {"model.vocab_size=0 must be >= 1"}},
      {{"model.vocab_multiple=0"}, 1, {"model.vocab_multiple=0 must be >= 1"}},
      {{"model.d_model=100", "model.n_head=3"}, 1, {"model.d_model=100 is not divisible by model.n_head=3"}},
      {{"model.arch=llama", "model.n_kv_head=3"}, 1, {"model.n_kv_head=3 does not divide model.n_head=4"}},
      {{"model.arch=llama", "model.n_head=8", "model.n_kv_head=2", "parallel.tp=4"}, 4,
       {"model.n_kv_head=2 is not divisible by parallel.tp=4"}},
      {{"model.arch=llama", "model.n_head=4", "model.d_model=12"}, 1, {"model.n_head=4", "odd", "rotary"}},
      {{"model.arch=llama", "model.rope_theta=1"}, 1, {"model.rope_theta=1 must be > 1"}},
      {{"model.arch=llama", "model.norm_eps=0"}, 1, {"model.norm_eps=0 must be > 0"}},
      {{"model.arch=llama", "model.rope_scaling.type=llama3", "model.rope_scaling.high_freq_factor=1"}, 1,
       {"model.rope_scaling.high_freq_factor=1 must be above model.rope_scaling.low_freq_factor=1"}},
      {{"model.arch=gpt2", "model.n_kv_head=2"}, 1, {"model.n_kv_head=2", "gpt2 has no grouped-query attention"}},
      {{"model.tie_embeddings=false"}, 1, {"model.tie_embeddings=false", "gpt2 always ties"}},
      {{"train.steps=0"}, 1, {"train.steps=0 must be >= 1"}},
      {{"train.global_batch=0"}, 1, {"train.global_batch=0 must be >= 1"}},
      {{"train.micro_batch=0"}, 1, {"train.micro_batch=0 must be >= 1"}},
      {{"train.seq_len=-1"}, 1, {"train.seq_len=-1 must be >= 0"}},
      {{"train.seq_len=128"}, 1, {"train.seq_len=128 exceeds model.seq_len=64"}},
      {{"parallel.schedule=zb_h1"}, 1, {"parallel.schedule=zb_h1 needs parallel.pp >= 2"}},
      {{"parallel.schedule=zb_h1", "parallel.pp=2", "parallel.virtual_stages=2"}, 2,
       {"parallel.virtual_stages=2 needs parallel.schedule=interleaved (got zb_h1)"}},
      {{"parallel.schedule=zb_v", "parallel.pp=2", "parallel.virtual_stages=2", "comm.ordered_p2p=true"}, 2,
       {"parallel.schedule=zb_v needs comm.ordered_p2p=false"}},
      {{"parallel.schedule=zb_v", "parallel.pp=2", "parallel.virtual_stages=2", "parallel.cp=2"}, 4,
       {"parallel.schedule=zb_v with parallel.cp=2 is untested: use parallel.cp=1"}},
      {{"parallel.schedule=zb_v", "parallel.pp=2", "parallel.virtual_stages=1"}, 2,
       {"parallel.schedule=zb_v needs parallel.virtual_stages=2"}},
      {{"parallel.tp=0"}, 1, {"parallel.tp=0 must be >= 1"}},
      {{"parallel.pp=0"}, 1, {"parallel.pp=0 must be >= 1"}},
      {{"parallel.dp=-1"}, 1, {"parallel.dp=-1 must be >= 0"}},
      {{"model.n_head=6", "model.d_model=96", "parallel.tp=4"}, 4,
       {"model.n_head=6 is not divisible by parallel.tp=4"}},
      {{"model.vocab_size=250", "model.vocab_multiple=2", "parallel.tp=4"}, 4,
       {"padded vocabulary 250", "model.vocab_size=250", "model.vocab_multiple=2", "parallel.tp=4"}},
      {{"model.n_layer=6", "parallel.pp=4"}, 4, {"model.n_layer=6 is not divisible by parallel.pp (4) x parallel.virtual_stages (1)"}},
      {{"train.global_batch=10", "train.micro_batch=4"}, 1,
       {"train.global_batch=10 is not divisible by train.micro_batch (4) x parallel.dp (1)"}},
      {{"train.global_batch=8", "train.micro_batch=2"}, 3,
       {"train.global_batch=8 is not divisible by train.micro_batch (2) x parallel.dp (3)"}},
      {{"train.lr=0"}, 1, {"train.lr=0 must be > 0"}},
      {{"train.warmup_steps=-1"}, 1, {"train.warmup_steps=-1 must be >= 0"}},
      {{"train.weight_decay=-0.1"}, 1, {"train.weight_decay=-0.1 must be >= 0"}},
      {{"train.beta1=1"}, 1, {"train.beta1=1 must be in [0, 1)"}},
      {{"train.beta2=-0.5"}, 1, {"train.beta2=-0.5 must be in [0, 1)"}},
      {{"train.eps=0"}, 1, {"train.eps=0 must be > 0"}},
      {{"train.grad_clip=-1"}, 1, {"train.grad_clip=-1 must be >= 0"}},
      {{"train.min_lr_ratio=1.5"}, 1, {"train.min_lr_ratio=1.5 must be in [0, 1]"}},
      {{"train.min_lr_ratio=-0.1"}, 1, {"train.min_lr_ratio=-0.1 must be in [0, 1]"}},
      {{"train.eval_every=-1"}, 1, {"train.eval_every=-1 must be >= 0"}},
      {{"train.eval_batches=0"}, 1, {"train.eval_batches=0 must be >= 1"}},
      {{"metrics.peak_tflops=-1"}, 1, {"metrics.peak_tflops=-1 must be >= 0"}},
      {{"metrics.log_every=0"}, 1, {"metrics.log_every=0 must be >= 1"}},
      {{"metrics.job="}, 1, {"metrics.job is empty"}},
      {{"metrics.prometheus=localhost"}, 1, {"metrics.prometheus='localhost' is not HOST:PORT"}},
      {{"metrics.prometheus=127.0.0.1:70000"}, 1, {"metrics.prometheus='127.0.0.1:70000'", "1..65535"}},
      {{"metrics.prometheus=:9400"}, 1, {"metrics.prometheus=':9400' is not HOST:PORT"}},
      {{"metrics.straggler_every=-1"}, 1, {"metrics.straggler_every=-1 must be >= 0"}},
      {{"metrics.straggler_ratio=1"}, 1, {"metrics.straggler_ratio=1 must be > 1"}},
      {{"metrics.straggler_checks=0"}, 1, {"metrics.straggler_checks=0 must be >= 1"}},
      {{"metrics.baseline_tolerance=1"}, 1, {"metrics.baseline_tolerance=1 must be in (0, 1)"}},
      {{"metrics.baseline_steps=0"}, 1, {"metrics.baseline_steps=0 must be >= 1"}},
      {{"faults.kind=slow_rank", "faults.step=1"}, 1, {"faults.kind=slow_rank needs faults.delay_ms > 0"}},
      {{"faults.kind=slow_rank", "faults.step=1", "faults.delay_ms=-3"}, 1, {"faults.delay_ms=-3 must be >= 0"}},
      {{"memory.limit_gb=-2"}, 1, {"memory.limit_gb=-2 must be >= 0"}},
      {{"data.train="}, 1, {"data.train is empty: set it to a dataset directory written by `xirang data prepare`"}},
      {{"data.train=/nonexistent/xirang"}, 1, {"data.train='/nonexistent/xirang'", "no such directory"}},
      {{"data.train=" + dir("empty")}, 1,
       {"data.train='" + dir("empty") + "': no dataset there (missing " + dir("empty") + "/index.json)"}},
      {{"data.val=" + dir("empty")}, 1, {"data.val='" + dir("empty") + "'", "index.json"}},
      {{"data.val=", "train.eval_every=5"}, 1, {"train.eval_every=5", "data.val"}},
      {{"parallel.zero=2"}, 1, {"parallel.zero=2 must be 0 or 1"}},
      {{"parallel.bucket_mb=0"}, 1, {"parallel.bucket_mb=0 must be > 0"}},
      {{"parallel.tp=4", "parallel.sequence_parallel=true", "train.micro_batch=1", "train.seq_len=30"}, 4,
       {"parallel.sequence_parallel", "30 token rows", "parallel.tp=4"}},
      {{"comm.timeout_s=0"}, 1, {"comm.timeout_s=0 must be > 0"}},
      {{"comm.latency_us=-1"}, 1, {"comm.latency_us=-1 must be >= 0"}},
      {{"faults.kind=kill", "faults.rank=3", "faults.step=1"}, 2, {"faults.rank=3", "0..1"}},
      {{"faults.kind=hang", "faults.step=0"}, 1, {"faults.step=0 must be >= 1"}},
      {{"precision.loss_scale=-2"}, 1, {"precision.loss_scale", "must be >= 0"}},
      {{"precision.initial_scale=0"}, 1, {"precision.initial_scale=0 must be > 0"}},
      {{"precision.growth_interval=0"}, 1, {"precision.growth_interval=0 must be >= 1"}},
      {{"precision.min_scale=0"}, 1, {"precision.min_scale=0 must be > 0"}},
      {{"precision.hysteresis=0"}, 1, {"precision.hysteresis=0 must be >= 1"}},
      {{"precision.min_scale=131072"}, 1, {"precision.min_scale=131072 is above precision.initial_scale=65536"}},
      {{"train.max_nonfinite_steps=0"}, 1, {"train.max_nonfinite_steps=0 must be >= 1"}},

      {{"faults.kind=nan_grad", "faults.step=2", "faults.steps=0"}, 1, {"faults.steps=0 must be >= 1"}},
      {{"train.skip_loss_spikes_zscore=-1"}, 1, {"train.skip_loss_spikes_zscore=-1 must be >= 0"}},

  };
  for (const Case& c : cases) expect_invalid(c.overrides, c.world, c.needles);
  // Messages start with the config's source so a multi-file run says which file.
  expect_invalid({"train.lr=0"}, 1, {"v.yaml: train.lr=0"});
}

// The rules no case above reaches: each column of the schema that the
// table above leaves out, broken once.
TEST_F(ConfigValidate, EveryFieldRuleIsChecked) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model.n_kv_head=-1", "model.n_kv_head=-1 must be >= 0 (0 means model.n_head)"},
      {"model.head_dim=-1", "model.head_dim=-1 must be >= 0 (0 means model.d_model / model.n_head)"},
      {"parallel.zero=-1", "parallel.zero=-1 must be 0 or 1"},
      {"parallel.virtual_stages=0", "parallel.virtual_stages=0 must be >= 1"},
      {"train.stop_after=-1", "train.stop_after=-1 must be >= 0 (0 runs to train.steps)"},
      {"data.prefetch_min=0", "data.prefetch_min=0 must be >= 1"},
      {"data.loader_threads=0", "data.loader_threads=0 must be >= 1"},
      {"data.read_delay_ms=-1", "data.read_delay_ms=-1 must be >= 0"},
      {"metrics.baseline_tolerance=0", "metrics.baseline_tolerance=0 must be in (0, 1)"},
      {"checkpoint.every=-1", "checkpoint.every=-1 must be >= 0 (0 saves only at the end)"},
      {"checkpoint.keep=0", "checkpoint.keep=0 must be >= 1"},
      {"comm.bandwidth_gbps=-1", "comm.bandwidth_gbps=-1 must be >= 0 (0 is no limit)"},
      {"faults.delay_ms=-1", "faults.delay_ms=-1 must be >= 0"},  // a rule of the key alone, any kind
      {"faults.steps=0", "faults.steps=0 must be >= 1"},
  };
  for (const auto& [override_, message] : cases) {
    SCOPED_TRACE(override_);
    Config c = base({override_});
    EXPECT_EQ(expect_config_error([&] { validate(c, 1); }, {}), "v.yaml: " + message);
  }
  // A NaN set from code breaks its rule too.
  Config nan = base();
  nan.train.lr = std::nan("");
  expect_config_error([&] { validate(nan, 1); }, {"train.lr=nan must be > 0"});
}

// Each rule's bound, on the side it allows: every config here is valid.
TEST_F(ConfigValidate, FieldRulesAcceptTheirEdges) {
  const std::vector<std::vector<std::string>> edges = {
      {"model.n_kv_head=0", "model.head_dim=0"},
      {"model.arch=llama", "model.n_kv_head=1"},
      {"parallel.dp=0", "parallel.zero=0"},
      {"parallel.zero=1"},
      {"parallel.bucket_mb=1.0e-6", "train.lr=1.0e-12", "train.eps=1.0e-30", "comm.timeout_s=1.0e-3"},
      {"train.seq_len=0", "train.warmup_steps=0", "train.weight_decay=0", "train.grad_clip=0", "train.stop_after=0"},
      {"train.beta1=0", "train.beta2=0", "train.min_lr_ratio=0"},
      {"train.beta1=0.999999", "train.beta2=0.999999", "train.min_lr_ratio=1"},
      {"train.eval_every=0", "train.eval_batches=1", "train.max_nonfinite_steps=1", "train.skip_loss_spikes_zscore=0"},
      {"data.prefetch_min=1", "data.prefetch_max=1", "data.loader_threads=1", "data.read_delay_ms=0"},
      {"metrics.peak_tflops=0", "metrics.log_every=1", "metrics.straggler_every=0", "metrics.straggler_checks=1",
       "metrics.baseline_steps=1", "metrics.straggler_ratio=1.000001", "metrics.baseline_tolerance=1.0e-6"},
      {"metrics.baseline_tolerance=0.999999", "metrics.prometheus=h:1", "memory.limit_gb=0"},
      {"precision.loss_scale=0", "precision.growth_interval=1", "precision.hysteresis=1",
       "precision.min_scale=1.0e-9", "precision.initial_scale=1.0e-9"},
      {"checkpoint.every=0", "checkpoint.keep=1", "comm.latency_us=0", "comm.bandwidth_gbps=0"},
      {"faults.delay_ms=0", "faults.steps=1"},
  };
  for (const auto& e : edges) {
    SCOPED_TRACE(::testing::PrintToString(e));
    Config c = base(e);
    EXPECT_NO_THROW(validate(c, 1));
  }
}

// Every key's own rule is reported before any rule between keys, and among
// them the first in schema order (model, parallel, train, data, metrics,
// memory, precision, device, checkpoint, comm, faults), whatever order
// the rules between keys are checked in.
TEST_F(ConfigValidate, ReportsFieldRulesInSchemaOrderThenRulesBetweenFields) {
  // One broken key per row, in schema order.
  const std::vector<std::pair<std::string, std::string>> in_order = {
      {"model.n_layer=0", "model.n_layer=0 must be >= 1"},
      {"model.head_dim=-2", "model.head_dim=-2 must be >= 0 (0 means model.d_model / model.n_head)"},
      {"parallel.zero=3", "parallel.zero=3 must be 0 or 1"},
      {"parallel.bucket_mb=0", "parallel.bucket_mb=0 must be > 0"},
      {"train.micro_batch=0", "train.micro_batch=0 must be >= 1"},
      {"train.lr=0", "train.lr=0 must be > 0"},
      {"train.beta1=1", "train.beta1=1 must be in [0, 1)"},
      {"data.loader_threads=0", "data.loader_threads=0 must be >= 1"},
      {"metrics.log_every=0", "metrics.log_every=0 must be >= 1"},
      {"metrics.baseline_steps=0", "metrics.baseline_steps=0 must be >= 1"},
      {"memory.limit_gb=-1", "memory.limit_gb=-1 must be >= 0 (0 is no limit)"},
      {"precision.hysteresis=0", "precision.hysteresis=0 must be >= 1"},
      {"checkpoint.keep=0", "checkpoint.keep=0 must be >= 1"},
      {"comm.timeout_s=0", "comm.timeout_s=0 must be > 0"},
      {"faults.steps=0", "faults.steps=0 must be >= 1"},
  };
  for (size_t i = 0; i < in_order.size(); ++i)
    for (size_t j = i + 1; j < in_order.size(); ++j) {
      SCOPED_TRACE(in_order[i].first + " and " + in_order[j].first);
      Config a = base({in_order[i].first, in_order[j].first});
      EXPECT_EQ(expect_config_error([&] { validate(a, 1); }, {}), "v.yaml: " + in_order[i].second);
      Config b = base({in_order[j].first, in_order[i].first});  // the overrides' order does not matter
      EXPECT_EQ(expect_config_error([&] { validate(b, 1); }, {}), "v.yaml: " + in_order[i].second);
    }
  // Rules between keys, each broken alone, then with the last key's own rule broken too.
  const std::vector<std::vector<std::string>> between = {
      {"train.seq_len=128"},
      {"model.d_model=100", "model.n_head=3"},
      {"model.n_layer=6", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"},
      {"train.global_batch=10", "train.micro_batch=4"},
      {"parallel.schedule=zb_h1"},
      {"data.prefetch_min=4", "data.prefetch_max=2"},
      {"precision.min_scale=131072"},
      {"faults.kind=hang"},
      {"data.train=/nonexistent/xirang"},
  };
  for (std::vector<std::string> rule : between) {
    SCOPED_TRACE(::testing::PrintToString(rule));
    Config alone = base(rule);
    const std::string own = expect_config_error([&] { validate(alone, 2); }, {});
    EXPECT_EQ(own.find("faults.steps=0"), std::string::npos) << own;
    rule.push_back("faults.steps=0");
    Config both = base(rule);
    EXPECT_EQ(expect_config_error([&] { validate(both, 2); }, {}), "v.yaml: faults.steps=0 must be >= 1");
  }
}

// The schedule's rules are schedule_problem()'s (runtime/config/schedule_rules.h):
// over kinds and layouts, validate refuses exactly where it does, in its words.
TEST_F(ConfigValidate, ScheduleRulesAreTheScheduleProblems) {
  int refused = 0;
  for (const char* kind : {"gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2"})
    for (int pp : {1, 2, 4})
      for (int v : {1, 2})
        for (int gb : {4, 6, 8}) {
          const std::vector<std::string> o = {std::string("parallel.schedule=") + kind, "parallel.pp=" + std::to_string(pp),
                                              "parallel.virtual_stages=" + std::to_string(v),
                                              "train.global_batch=" + std::to_string(gb)};
          SCOPED_TRACE(::testing::PrintToString(o));
          Config c = base(o);
          if (v > 1 && pp == 1) continue;  // the model's layout rule (virtual stages interleave ranks) comes first
          const std::string rule = schedule_problem(c.parallel.schedule, pp, v, gb);
          if (rule.empty()) {
            EXPECT_NO_THROW(validate(c, pp));
            continue;
          }
          ++refused;
          const std::string msg = expect_config_error([&] { validate(c, pp); }, {});
          // The message up to the microbatch count's derivation is the rule's.
          const size_t cut = rule.find(" (");
          EXPECT_EQ(msg.substr(0, 8 + cut), "v.yaml: " + rule.substr(0, cut)) << rule;
        }
  EXPECT_GT(refused, 10);
}

TEST_F(ConfigValidate, TraceStepsAreARange) {
  Config c = base({"metrics.trace_steps=3-7"});
  validate(c, 1);
  EXPECT_EQ(c.metrics.trace_steps.first, 3);
  EXPECT_EQ(c.metrics.trace_steps.last, 7);
  EXPECT_NE(c.yaml.find("trace_steps: \"3-7\""), std::string::npos) << c.yaml;
  c = base({"metrics.trace_steps=5"});
  validate(c, 1);
  EXPECT_EQ(c.metrics.trace_steps.first, 5);
  EXPECT_EQ(c.metrics.trace_steps.last, 5);
  EXPECT_EQ(parse_config(c.yaml).metrics.trace_steps.last, 5);
  // Read when the config is: one line naming the key, the value and what a range is.
  expect_parse_error("", {"metrics.trace_steps='4-2' is not a step range A-B with 1 <= A <= B"}, {"metrics.trace_steps=4-2"});
  expect_parse_error("", {"metrics.trace_steps='0-3'", "1 <= A <= B"}, {"metrics.trace_steps=0-3"});
  expect_parse_error("", {"metrics.trace_steps='2-'", "(e.g. 2-4)"}, {"metrics.trace_steps=2-"});
  expect_parse_error("metrics:\n  trace_steps: two\n", {"test.yaml:2", "metrics.trace_steps='two'"});
}

TEST_F(ConfigValidate, BooleansAreTrueOrFalse) {
  EXPECT_TRUE(base({"parallel.sequence_parallel=true"}).parallel.sequence_parallel);
  EXPECT_FALSE(base({"parallel.overlap_grad_reduce=false"}).parallel.overlap_grad_reduce);
  try {
    base({"parallel.sequence_parallel=yes"});
    FAIL() << "expected a config error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("expected true or false"), std::string::npos) << e.what();
  }
}

TEST_F(ConfigValidate, SlowRankStartsAtStepOneByDefault) {
  Config c = base({"faults.kind=slow_rank", "faults.delay_ms=150"});
  validate(c, 1);
  EXPECT_EQ(c.faults.step, 1);
  c = base({"faults.kind=slow_rank", "faults.delay_ms=150", "faults.step=3"});
  validate(c, 1);
  EXPECT_EQ(c.faults.step, 3);
  // The other kinds still need their step.
  expect_invalid({"faults.kind=kill"}, 1, {"faults.step=0 must be >= 1"});
}

TEST_F(ConfigValidate, EmptyResumePath) {
  expect_invalid({"checkpoint.resume="}, 1, {"checkpoint.resume is empty", "auto, none"});
}

TEST_F(ConfigValidate, EvalDisabledNeedsNoValidationSplit) {
  Config c = base({"data.val=", "train.eval_every=0"});
  validate(c, 1);
}

// model.preset fills every model field first, wherever it is written; the
// other model keys (file, then overrides) change it; the emitted YAML reads
// back to the same config.
TEST_F(ConfigValidate, PresetsFillTheModelAndKeysChangeIt) {
  Config c = parse_config("model:\n  n_layer: 2\n  preset: qwen3_0.6b\n", {"model.seq_len=128"});
  EXPECT_EQ(c.model.arch, "qwen3");
  EXPECT_EQ(c.model.preset, "qwen3_0.6b");
  EXPECT_EQ(c.model.n_layer, 2);  // the file's key, though written before the preset
  EXPECT_EQ(c.model.max_seq_len, 128);
  EXPECT_EQ(c.model.d_model, 1024);
  EXPECT_EQ(c.model.head_size(), 128);
  EXPECT_EQ(c.model.rope.theta, 1e6);
  EXPECT_EQ(c.model.tie_embeddings, std::optional<bool>(true));
  EXPECT_EQ(parse_config(c.yaml).yaml, c.yaml);
  // An override's preset replaces the file's whole model section; the overrides after it change it.
  Config o = parse_config("model:\n  arch: gpt2\n  preset: gpt2_124m\n  n_layer: 3\n",
                          {"model.preset=llama3.1_8b", "model.n_layer=4"});
  EXPECT_EQ(o.model.arch, "llama");
  EXPECT_EQ(o.model.n_layer, 4);
  EXPECT_EQ(o.model.kv_heads(), 8);
  EXPECT_EQ(parse_config("model:\n  n_layer: 3\n", {"model.preset=llama3_8b"}).model.n_layer, 32);
  EXPECT_EQ(o.model.rope.scaling.type, RopeScaling::Type::Llama3);
  EXPECT_EQ(o.model.max_seq_len, 131072);
  // Every preset validates as it is.
  auto preset = [&](const std::vector<std::string>& overrides) {
    std::vector<std::string> all = {"data.train=" + dir("train"), "data.val=" + dir("val")};
    all.insert(all.end(), overrides.begin(), overrides.end());
    return parse_config("train: {steps: 10, global_batch: 8, micro_batch: 1}\n", all, "v.yaml");
  };
  for (const std::string name : {"gpt2_124m", "llama3_70b", "llama3.2_1b", "qwen3_8b"}) {
    Config p = preset({"model.preset=" + name});
    EXPECT_EQ(p.model.preset, name);
    validate(p, 1);
  }
  // A checkpoint's stored config keeps a preset a later build dropped as a label: it spells out every key.
  std::string stored = c.yaml;
  stored.replace(stored.find("qwen3_0.6b"), 10, "qwen3_old");
  const Config s = parse_stored_config(stored, "meta.json");
  EXPECT_EQ(s.model.preset, "qwen3_old");
  EXPECT_EQ(s.model.d_model, 1024);
  EXPECT_EQ(s.model.n_layer, 2);
  expect_config_error([&] { parse_config(stored); }, {"model.preset='qwen3_old' is not a preset"});
  expect_parse_error("model:\n  preset: llama9\n", {"test.yaml:2: model.preset='llama9' is not a preset (presets: ",
                                                     "qwen3_0.6b"});
  expect_parse_error("", {"override 'model.preset=gpt3': model.preset='gpt3' is not a preset"},
                     {"model.preset=gpt3"});
  expect_parse_error("model:\n  preset: llama3_8b\n  arch: gpt2\n",
                     {"test.yaml: model.preset=llama3_8b is a model.arch=llama model (Llama 3 8B), but model.arch=gpt2"});
  expect_parse_error("", {"model.preset=qwen3_8b is a model.arch=qwen3 model"}, {"model.preset=qwen3_8b", "model.arch=llama"});
}

// The shipped configs parse, and the debug config fits every layout the
// multi-rank tests use (dp, tp, pp each up to 4).
TEST_F(ConfigValidate, ShippedConfigs) {
  const std::string configs = std::string(XIRANG_SOURCE_DIR) + "/configs/";
  const std::vector<std::string> data = {"data.train=" + dir("train"), "data.val=" + dir("val")};
  for (const char* name : {"gpt2_debug.yaml", "gpt2_demo.yaml", "gpt2_124m.yaml", "llama_debug.yaml", "llama_demo.yaml",
                           "llama3_8b.yaml", "qwen3_debug.yaml"}) {
    SCOPED_TRACE(name);
    Config c = load_config(configs + name, data);
    validate(c, 1);
  }
  Config debug = load_config(configs + "gpt2_debug.yaml");
  EXPECT_EQ(debug.data.train, "data/debug/train");
  EXPECT_EQ(debug.model.vocab_size, 256);
  for (int dp : {1, 2, 4})
    for (int tp : {1, 2, 4})
      for (int pp : {1, 2, 4}) {
        SCOPED_TRACE(::testing::Message() << "dp " << dp << " tp " << tp << " pp " << pp);
        std::vector<std::string> layout = data;
        layout.push_back("parallel.tp=" + std::to_string(tp));
        layout.push_back("parallel.pp=" + std::to_string(pp));
        Config c = load_config(configs + "gpt2_debug.yaml", layout);
        validate(c, dp * tp * pp);
        EXPECT_EQ(c.parallel.dp, dp);
        // pp=2 with 2 virtual stages needs n_layer % 4 == 0.
        EXPECT_EQ(c.model.n_layer % (pp * 2), 0);
      }
}

}  // namespace
}  // namespace xirang
