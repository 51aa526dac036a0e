// Tests for runtime/config: parsing, overrides, named values, emitting, and
// the one-line errors that name the key (validate()'s rules:
// config_validate_test.cc).
#include "runtime/config/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/runtime/config_errors.h"

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
  expect_parse_error("", {"parallel.schedule='zigzag' is not one of gpipe, 1f1b, interleaved, zb_h1, zb_h2, zb_v"},
                     {"parallel.schedule=zigzag"});
  expect_parse_error("", {"comm.busy_poll='always' is not one of auto, on, off"}, {"comm.busy_poll=always"});
  expect_parse_error("checkpoint:\n  on_error: retry\n", {"test.yaml:2", "checkpoint.on_error='retry' is not one of stop, continue"});
  EXPECT_EQ(parse_config("parallel:\n  schedule: zb_h1\n").parallel.schedule, ScheduleKind::ZeroBubbleH1);
  EXPECT_EQ(parse_config("parallel:\n  schedule: zb_h2\n").parallel.schedule, ScheduleKind::ZeroBubbleH2);
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
}  // namespace
}  // namespace xirang
