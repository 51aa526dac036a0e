// Tests for runtime/config: parsing, overrides, the one-line errors that name
// the key, and every rule of validate().
#include "runtime/config/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

// Every field differs from its default, so a field the parser skips shows.
const char* kFullConfig = R"(
model:
  arch: gpt2
  n_layer: 8
  n_head: 4
  d_model: 64
  seq_len: 64
  vocab_size: 256
  vocab_multiple: 64
parallel:
  dp: 2
  tp: 2
  pp: 2
train:
  steps: 20
  global_batch: 16
  micro_batch: 2
  seq_len: 32
  lr: 1e-3
  min_lr_ratio: 0.2
  warmup_steps: 3
  weight_decay: 0.05
  beta1: 0.8
  beta2: 0.99
  eps: 1e-6
  grad_clip: 0.5
  seed: 18446744073709551615
  eval_every: 5
  eval_batches: 2
  recompute: full
data:
  train: some/train
  val: some/val
metrics:
  jsonl: runs/x/metrics.jsonl
  peak_tflops: 12.5
  log_every: 10
memory:
  limit_gb: 3.5
)";

void expect_same(const Config& a, const Config& b) {
  EXPECT_EQ(a.model.arch, b.model.arch);
  EXPECT_EQ(a.model.n_layer, b.model.n_layer);
  EXPECT_EQ(a.model.n_head, b.model.n_head);
  EXPECT_EQ(a.model.d_model, b.model.d_model);
  EXPECT_EQ(a.model.max_seq_len, b.model.max_seq_len);
  EXPECT_EQ(a.model.vocab_size, b.model.vocab_size);
  EXPECT_EQ(a.model.vocab_multiple, b.model.vocab_multiple);
  EXPECT_EQ(a.parallel.dp, b.parallel.dp);
  EXPECT_EQ(a.parallel.tp, b.parallel.tp);
  EXPECT_EQ(a.parallel.pp, b.parallel.pp);
  EXPECT_EQ(a.train.steps, b.train.steps);
  EXPECT_EQ(a.train.global_batch, b.train.global_batch);
  EXPECT_EQ(a.train.micro_batch, b.train.micro_batch);
  EXPECT_EQ(a.train.seq_len, b.train.seq_len);
  EXPECT_EQ(a.train.lr, b.train.lr);  // exact: the emitter must round-trip doubles
  EXPECT_EQ(a.train.min_lr_ratio, b.train.min_lr_ratio);
  EXPECT_EQ(a.train.warmup_steps, b.train.warmup_steps);
  EXPECT_EQ(a.train.weight_decay, b.train.weight_decay);
  EXPECT_EQ(a.train.beta1, b.train.beta1);
  EXPECT_EQ(a.train.beta2, b.train.beta2);
  EXPECT_EQ(a.train.eps, b.train.eps);
  EXPECT_EQ(a.train.grad_clip, b.train.grad_clip);
  EXPECT_EQ(a.train.seed, b.train.seed);
  EXPECT_EQ(a.train.eval_every, b.train.eval_every);
  EXPECT_EQ(a.train.eval_batches, b.train.eval_batches);
  EXPECT_EQ(a.train.recompute, b.train.recompute);
  EXPECT_EQ(a.data.train, b.data.train);
  EXPECT_EQ(a.data.val, b.data.val);
  EXPECT_EQ(a.metrics.jsonl, b.metrics.jsonl);
  EXPECT_EQ(a.metrics.peak_tflops, b.metrics.peak_tflops);
  EXPECT_EQ(a.metrics.log_every, b.metrics.log_every);
  EXPECT_EQ(a.memory.limit_gb, b.memory.limit_gb);
}

// Runs fn, expects an Error of kind Config on one line that contains every
// needle; returns the message for further checks.
std::string expect_config_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::Config) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    return msg;
  }
  ADD_FAILURE() << "no error thrown; expected one containing '" << (needles.empty() ? "" : needles[0]) << "'";
  return "";
}

void expect_parse_error(const std::string& yaml, const std::vector<std::string>& needles,
                        const std::vector<std::string>& overrides = {}) {
  SCOPED_TRACE(yaml);
  expect_config_error([&] { parse_config(yaml, overrides, "test.yaml"); }, needles);
}

TEST(ConfigParse, FullConfigSetsEveryField) {
  Config c = parse_config(kFullConfig, {}, "full.yaml");
  EXPECT_EQ(c.source, "full.yaml");
  EXPECT_EQ(c.model.arch, "gpt2");
  EXPECT_EQ(c.model.n_layer, 8);
  EXPECT_EQ(c.model.n_head, 4);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_EQ(c.model.max_seq_len, 64);
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.vocab_multiple, 64);
  EXPECT_EQ(c.parallel.dp, 2);
  EXPECT_EQ(c.parallel.tp, 2);
  EXPECT_EQ(c.parallel.pp, 2);
  EXPECT_EQ(c.train.steps, 20);
  EXPECT_EQ(c.train.global_batch, 16);
  EXPECT_EQ(c.train.micro_batch, 2);
  EXPECT_EQ(c.train.seq_len, 32);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.train.min_lr_ratio, 0.2);
  EXPECT_EQ(c.train.warmup_steps, 3);
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(c.train.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.train.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.train.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 0.5);
  EXPECT_EQ(c.train.seed, 18446744073709551615ull);
  EXPECT_EQ(c.train.eval_every, 5);
  EXPECT_EQ(c.train.eval_batches, 2);
  EXPECT_EQ(c.train.recompute, Recompute::Full);
  EXPECT_EQ(c.data.train, "some/train");
  EXPECT_EQ(c.data.val, "some/val");
  EXPECT_EQ(c.metrics.jsonl, "runs/x/metrics.jsonl");
  EXPECT_DOUBLE_EQ(c.metrics.peak_tflops, 12.5);
  EXPECT_EQ(c.metrics.log_every, 10);
  EXPECT_DOUBLE_EQ(c.memory.limit_gb, 3.5);
  EXPECT_EQ(c.seq_len(), 32);
  EXPECT_EQ(c.microbatches(), 4);
}

TEST(ConfigParse, EmptyTextAndEmptySectionsGiveDefaults) {
  Config defaults;
  expect_same(parse_config(""), defaults);
  expect_same(parse_config("model:\nmetrics:\n"), defaults);
}

TEST(ConfigParse, DoublesAcceptIntegersAndStringsAcceptAnyScalar) {
  Config c = parse_config("train:\n  lr: 1\n  grad_clip: +2\ndata:\n  train: 123\n  val: ~\n");
  EXPECT_EQ(c.train.lr, 1.0);
  EXPECT_EQ(c.train.grad_clip, 2.0);
  EXPECT_EQ(c.data.train, "123");
  EXPECT_EQ(c.data.val, "");
}

TEST(ConfigParse, OverridesWinInOrder) {
  Config c = parse_config(kFullConfig, {"train.steps=7", "train.lr=0.5", "train.steps=9", "data.val=",
                                        "data.train=a=b", "parallel.tp=4"});
  EXPECT_EQ(c.train.steps, 9);
  EXPECT_EQ(c.train.lr, 0.5);
  EXPECT_EQ(c.data.val, "");
  EXPECT_EQ(c.data.train, "a=b");  // only the first '=' splits
  EXPECT_EQ(c.parallel.tp, 4);
  EXPECT_EQ(c.model.n_layer, 8);  // untouched keys keep the file's value
  EXPECT_NE(c.yaml.find("steps: 9"), std::string::npos) << c.yaml;
}

TEST(ConfigParse, OverridesAreTypeChecked) {
  expect_parse_error(kFullConfig, {"override 'model.n_head=abc'", "model.n_head", "'abc'", "expected an integer"},
                     {"model.n_head=abc"});
  expect_parse_error(kFullConfig, {"train.steps", "'2.5'", "integer"}, {"train.steps=2.5"});
  expect_parse_error(kFullConfig, {"train.lr", "'fast'", "number"}, {"train.lr=fast"});
  expect_parse_error(kFullConfig, {"train.steps", "''"}, {"train.steps="});
}

TEST(ConfigParse, MalformedOverrides) {
  for (const char* bad : {"trainsteps=5", "train.steps", ".steps=5", "train.=5", "steps=train.x"}) {
    expect_parse_error(kFullConfig, {std::string("override '") + bad + "'", "malformed", "section.key=value"},
                       {bad});
  }
}

TEST(ConfigParse, UnknownOverrideKeyOrSection) {
  expect_parse_error(kFullConfig, {"override 'train.microbatch=2'", "unknown key 'train.microbatch'",
                                   "known keys in train: steps, global_batch, micro_batch"},
                     {"train.microbatch=2"});
  expect_parse_error(kFullConfig, {"unknown section 'optim'", "known sections: model, parallel"}, {"optim.lr=1"});
}

TEST(ConfigParse, UnknownKeysInFile) {
  expect_config_error([] { parse_config("train:\n  steps: 5\n  microbatch: 2\n", {}, "configs/x.yaml"); },
                      {"configs/x.yaml:3", "unknown key 'train.microbatch'",
                       "(known keys in train: steps, global_batch, micro_batch,"});
  expect_parse_error("optimizer:\n  lr: 1\n",
                     {"unknown section 'optimizer'", "known sections: model, parallel, train"});
  // An unknown section is reported even when it is empty.
  expect_parse_error("modle:\n", {"unknown section 'modle'"});
}

TEST(ConfigParse, WrongValueTypes) {
  expect_parse_error("model:\n  n_head: abc\n", {"key 'model.n_head' has value 'abc', expected an integer"});
  expect_parse_error("model:\n  n_head: 2.5\n", {"model.n_head", "'2.5'", "integer"});
  expect_parse_error("model:\n  n_head: 1e3\n", {"model.n_head", "'1e3'"});
  expect_parse_error("model:\n  n_head: 99999999999\n", {"model.n_head", "99999999999"});
  expect_parse_error("model:\n  n_head:\n", {"model.n_head", "no value", "integer"});
  expect_parse_error("train:\n  seed: -1\n", {"train.seed", "'-1'", "non-negative integer"});
  expect_parse_error("train:\n  lr: fast\n", {"train.lr", "'fast'", "number"});
  expect_parse_error("train:\n  lr: .inf\n", {"train.lr", "'.inf'", "finite"});
  expect_parse_error("train:\n  lr: nan\n", {"train.lr", "'nan'"});
  // A block scalar's newlines must not break the one-line promise.
  expect_parse_error("train:\n  lr: |\n    1\n    2\n", {"train.lr", "expected a finite number"});
}

TEST(ConfigParse, CollectionWhereScalarExpected) {
  expect_parse_error("model:\n  n_head: [1, 2]\n", {"model.n_head", "a sequence", "expected an integer"});
  expect_parse_error("data:\n  train: {a: 1}\n", {"data.train", "a mapping", "expected a string"});
  expect_parse_error("train: 5\n", {"section 'train'", "mapping", "steps, global_batch"});
  expect_parse_error("- model\n- train\n", {"top level", "mapping"});
}

// Named values become enums as they are read: a bad one fails at parse time
// with the same words validate() uses for its rules.
TEST(ConfigParse, NamedValues) {
  Config c = parse_config("precision: {dtype: bf16}\ndevice: {backend: cuda}\nfaults: {kind: kill_in_save}\n",
                          {"checkpoint.resume=none"});
  EXPECT_EQ(c.precision.dtype, Precision::BF16);
  EXPECT_EQ(c.device.backend, Backend::CUDA);
  EXPECT_EQ(c.faults.kind, FaultKind::KillInSave);
  EXPECT_EQ(c.checkpoint.resume, ResumeMode::None);
  EXPECT_EQ(parse_config("").checkpoint.resume, ResumeMode::Auto);
  Config p = parse_config("", {"checkpoint.resume=runs/a/step_00000010"});
  EXPECT_EQ(p.checkpoint.resume, ResumeMode::Path);
  EXPECT_EQ(p.checkpoint.resume_path, "runs/a/step_00000010");
  EXPECT_NE(p.yaml.find("resume: \"runs/a/step_00000010\""), std::string::npos) << p.yaml;
  EXPECT_NE(c.yaml.find("dtype: \"bf16\""), std::string::npos) << c.yaml;
  EXPECT_EQ(config_name(FaultKind::FailTransfer), std::string("fail_transfer"));

  expect_parse_error("", {"faults.kind='explode'", "kill, hang, fail_transfer, kill_in_save"},
                     {"faults.kind=explode", "faults.step=1"});
  expect_parse_error("", {"precision.dtype='fp8'", "fp32, bf16, fp16"}, {"precision.dtype=fp8"});
  expect_parse_error("", {"device.backend='tpu'", "cpu, cuda"}, {"device.backend=tpu"});
  expect_parse_error("", {"parallel.schedule='zigzag' is not one of gpipe, 1f1b, interleaved, zb_h1"},
                     {"parallel.schedule=zigzag"});
  expect_parse_error("", {"comm.busy_poll='always' is not one of auto, on, off"}, {"comm.busy_poll=always"});
  expect_parse_error("checkpoint:\n  on_error: retry\n", {"test.yaml:2", "checkpoint.on_error='retry' is not one of stop, continue"});
  EXPECT_EQ(parse_config("parallel:\n  schedule: zb_h1\n").parallel.schedule, ScheduleKind::ZeroBubbleH1);
  expect_parse_error("device:\n  backend: tpu\n", {"test.yaml:2", "device.backend='tpu'", "cpu, cuda"});
  expect_parse_error("precision:\n  dtype:\n", {"precision.dtype=''", "fp32, bf16, fp16"});

  EXPECT_EQ(parse_config("").train.recompute, Recompute::None);
  EXPECT_EQ(parse_config("train:\n  recompute: selective\n").train.recompute, Recompute::Selective);
  EXPECT_EQ(parse_config("", {"train.recompute=full"}).train.recompute, Recompute::Full);
  expect_parse_error("", {"train.recompute='partial'", "none, selective, full"}, {"train.recompute=partial"});
  expect_parse_error("train:\n  recompute: yes\n", {"test.yaml:2", "train.recompute='yes'", "none, selective, full"});
}

// LLaMA's keys: rope_scaling is a nested mapping (as in config.json), an
// override spells it with two dots, the emitted YAML nests it again.
TEST(ConfigParse, LlamaKeysAndTheNestedRopeScaling) {
  Config c = parse_config(
      "model:\n  arch: llama\n  n_kv_head: 2\n  ffn_hidden: 96\n  rope_theta: 500000\n  norm_eps: 1.0e-6\n"
      "  tie_embeddings: true\n  rope_scaling:\n    type: llama3\n    factor: 16\n"
      "    original_max_position_embeddings: 4096\n",
      {"model.rope_scaling.low_freq_factor=2"});
  EXPECT_EQ(c.model.arch, "llama");
  EXPECT_EQ(c.model.n_kv_head, 2);
  EXPECT_EQ(c.model.ffn_hidden, 96);
  EXPECT_EQ(c.model.rope.theta, 500000.0);
  EXPECT_EQ(c.model.norm_eps, 1e-6);
  EXPECT_EQ(c.model.tie_embeddings, std::optional<bool>(true));
  EXPECT_EQ(c.model.rope.scaling.type, RopeScaling::Type::Llama3);
  EXPECT_EQ(c.model.rope.scaling.factor, 16.0);
  EXPECT_EQ(c.model.rope.scaling.low_freq_factor, 2.0);
  EXPECT_EQ(c.model.rope.scaling.high_freq_factor, 4.0);  // the default
  EXPECT_EQ(c.model.rope.scaling.original_max_position_embeddings, 4096.0);
  EXPECT_NE(c.yaml.find("  rope_scaling:\n    type: \"llama3\"\n    factor: 16"), std::string::npos) << c.yaml;
  Config back = parse_config(c.yaml);
  EXPECT_EQ(back.yaml, c.yaml);
  EXPECT_EQ(back.model.rope.scaling.low_freq_factor, 2.0);
  EXPECT_EQ(parse_config("").model.tie_embeddings, std::nullopt);

  // An unknown scaling type: one line naming the key, the value and the known types.
  expect_parse_error("model:\n  rope_scaling:\n    type: yarn\n",
                     {"test.yaml:3", "model.rope_scaling.type='yarn'", "none, llama3"});
  expect_parse_error("", {"model.rope_scaling.type='dynamic'", "none, llama3"}, {"model.rope_scaling.type=dynamic"});
  expect_parse_error("model:\n  rope_scaling: llama3\n", {"model.rope_scaling", "expected a mapping"});
  expect_parse_error("model:\n  rope_scaling: {kind: llama3}\n", {"unknown key 'model.rope_scaling.kind'"});
  expect_parse_error("model:\n  tie_embeddings: maybe\n", {"model.tie_embeddings='maybe'", "auto, true, false"});
}

TEST(ConfigParse, RepeatedKeysAreErrors) {
  expect_parse_error("train:\n  steps: 5\n  steps: 6\n", {"train.steps", "twice"});
  expect_parse_error("train:\n  steps: 5\ntrain:\n  lr: 1\n", {"section 'train'", "twice"});
}

TEST(ConfigParse, YamlSyntaxErrorGivesLineAndColumn) {
  expect_config_error([] { parse_config("model:\n  n_head: [1, 2\n", {}, "bad.yaml"); },
                      {"bad.yaml", "YAML syntax error", "line", "column"});
  expect_config_error([] { parse_config("model:\n  n_head: 4\n bad: 1\n", {}, "bad.yaml"); }, {"bad.yaml", "line 3"});
}

TEST(ConfigLoad, MissingFile) {
  expect_config_error([] { load_config("/nonexistent/x.yaml"); },
                      {"cannot open config file '/nonexistent/x.yaml': No such file or directory"});
  expect_config_error([] { load_config(::testing::TempDir()); }, {"cannot open config file", "directory"});
}

TEST(ConfigLoad, ReadsFileAndAppliesOverrides) {
  fs::path path = fs::path(::testing::TempDir()) / ("xirang_config_load_" + std::to_string(getpid()) + ".yaml");
  { std::ofstream(path) << kFullConfig; }
  Config c = load_config(path.string(), {"train.steps=99"});
  fs::remove(path);
  EXPECT_EQ(c.source, path.string());
  EXPECT_EQ(c.train.steps, 99);
  EXPECT_EQ(c.model.d_model, 64);
}

TEST(ConfigParse, EmittedYamlParsesBackToTheSameConfig) {
  for (const std::string& text : {std::string(kFullConfig), std::string("")}) {
    Config a = parse_config(text, {"data.val=null", "train.lr=6e-4", "train.beta2=0.1"});
    EXPECT_EQ(a.data.val, "null");  // a string that YAML would read as unset if emitted plain
    Config b = parse_config(a.yaml);
    expect_same(a, b);
    EXPECT_EQ(a.yaml, b.yaml);
    EXPECT_NE(a.yaml.find("lr: 6.0e-04"), std::string::npos) << a.yaml;  // shortest form, not 0.00059999...
  }
  // Every section and key is recorded, including the defaults.
  Config d = parse_config("");
  for (const char* key : {"model:", "parallel:", "train:", "data:", "metrics:", "memory:", "vocab_multiple:",
                          "min_lr_ratio:", "eval_batches:", "peak_tflops:", "limit_gb:", "seed: 1234"})
    EXPECT_NE(d.yaml.find(key), std::string::npos) << key << " missing from:\n" << d.yaml;
}

// validate() needs dataset directories; each test gets its own with an index.json.
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
  for (const std::string& name : {"gpt2_124m", "llama3_70b", "llama3.2_1b", "qwen3_8b"}) {
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
