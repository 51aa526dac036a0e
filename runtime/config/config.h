// runtime/config/config.h: the typed run configuration.
//
// A YAML file (yaml-cpp) becomes a Config; strings stop here. Each subsystem
// owns one struct; load_config() rejects unknown keys and wrong types, and
// validate() checks the rules between fields. Every error names the key, the
// value and the rule, in one line.
//
//   Config c = load_config("configs/gpt2_debug.yaml", {"train.steps=20", "parallel.tp=2"});
//   validate(c, world_size);   // throws Error(ErrorKind::Config, "...")
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/dims.h"
#include "models/layers/activation.h"
#include "runtime/config/named_values.h"

namespace xirang {

// The named values (ScheduleKind, Precision, Backend, FaultKind,
// BusyPollMode, SaveErrorPolicy, Recompute, RopeScaling::Type) and their
// spellings: runtime/config/named_values.h. They are parsed once when the
// YAML is read (an unknown spelling is a Config error naming the key, the
// value and the accepted spellings); code past runtime/config compares
// enums, not text.

// parallel.schedule's spelling and reading (config_name, parse_named).
inline const char* schedule_name(ScheduleKind k) { return config_name(k); }
inline ScheduleKind parse_schedule(std::string_view name, std::string_view where) {
  return parse_named<ScheduleKind>(name, where);
}
// Whether its lists split each backward into BackwardInput and BackwardWeight
// (the chunks then keep what the weight part needs: ChunkBatch::split_backward).
bool splits_backward(ScheduleKind k);

// A range of steps, 1-based and inclusive (metrics.trace_steps: "2-4", or "3" for one).
struct StepRange {
  int first = 1, last = 1;
};
// checkpoint.resume: auto, none, or the path of a step directory
enum class ResumeMode { Auto, None, Path };

struct ParallelConfig {
  int dp = 0;  // 0: inferred as world / (cp * tp * pp)
  int tp = 1;
  int pp = 1;
  // Context parallelism: each sequence cut over cp ranks (T / cp rows each,
  // keys and values gathered in attention); parameters are replicated over
  // cp, their gradients reduced over dp x cp.
  int cp = 1;
  CpSplit cp_split = CpSplit::HeadTail;  // which chunks of a sequence each cp rank holds
  // Expert parallelism: the experts sharded over ep of the dp ranks (ep
  // divides dp; the world size does not change). comm/process_grid.h.
  int ep = 1;
  CpCommKind cp_comm = CpCommKind::AllGather;  // all_gather or ring (CPU backend only)
  int zero = 0;                     // 1: ZeRO-1, optimizer state sharded over dp
  double bucket_mb = 25;            // gradient bucket size for the dp reduction
  bool overlap_grad_reduce = true;  // start each bucket's reduction during the backward pass
  bool sequence_parallel = false;   // split LayerNorm regions along the tokens over tp
  ScheduleKind schedule = ScheduleKind::OneFOneB;  // pipeline schedule: gpipe, 1f1b, interleaved, zb_h1, zb_h2, zb_v
  int virtual_stages = 1;           // model chunks per pipeline rank (interleaved: >= 2)
};

// Communication settings; latency and bandwidth inject a slower link (tests, benchmarks).
struct CommConfig {
  double timeout_s = 300;     // an operation outstanding longer than this ends the job
  double latency_us = 0;      // added to every operation
  double bandwidth_gbps = 0;  // gigabytes per second per link; 0 is no limit
  // Pipeline transfers matched by order, as NCCL matches them (OrderedLink
  // over MPI): the CPU check that the executor's order works on NCCL.
  bool ordered_p2p = false;
  // A one-rank CUDA run builds NCCL groups of one rank (a test switch: the
  // device communication paths, the dp stream's bucket all-reduces and
  // joins, ZeRO's reduce-scatter and gather, then run on a single GPU,
  // where NCCL refuses two ranks of one communicator).
  bool nccl_alone = false;
  // How MPI channels poll while a rank waits on them: auto (busy where the
  // node's ranks' compute threads do not outnumber its CPUs), on, off
  // (comm/communicator.h BusyPoll).
  BusyPollMode busy_poll = BusyPollMode::Auto;
  // Where a rank whose operation timed out writes comm_trace.rank<N>.json
  // (its recent operations, for `xirang diagnose`); empty: the directory of
  // metrics.jsonl, else checkpoint.dir, else the working directory.
  std::string trace_dir;
};

// Fault injection for tests: at the start of `step` (1-based), rank `rank`
// is killed (kill), stops answering (hang), or fails its next transfer
// (fail_transfer); kill_in_save kills it halfway through writing the
// checkpoint of `step`, and io_error makes that write fail there as a
// failing disk does (EIO).
struct FaultConfig {
  FaultKind kind = FaultKind::None;
  int rank = 0;
  int step = 0;         // 0: unset; slow_rank then starts at step 1, the other kinds need it
  double delay_ms = 0;  // slow_rank: extra compute time of that rank in every step from `step` on
  int steps = 1;        // nan_grad: poison that rank's gradient in `steps` steps from `step` on
};

struct TrainConfig {
  int steps = 10;
  int global_batch = 8;  // sequences per optimizer step (all dp ranks, all microbatches)
  int micro_batch = 1;   // sequences per microbatch per dp rank
  int seq_len = 0;       // tokens per sequence; 0 means model.seq_len
  double lr = 6e-4;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int warmup_steps = 0;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // global-norm clip; 0 disables
  uint64_t seed = 1234;
  int eval_every = 0;    // 0 disables validation
  int eval_batches = 4;  // microbatches of validation data per evaluation
  Recompute recompute = Recompute::None;  // activation recomputation in backward (models/layers/activation.h)
  double skip_loss_spikes_zscore = 0;  // skip an update whose loss is z std devs above the last 128 steps'; 0: off
  int max_nonfinite_steps = 3;  // consecutive steps skipped for a non-finite loss or gradient before the run stops
  int stop_after = 0;    // end this run after that many completed steps (a job time limit; the schedule still spans `steps`); 0: run to `steps`
};

struct DataConfig {
  std::string train;  // dataset split directory (written by `xirang data prepare`)
  std::string val;    // optional
  bool prefetch = true;     // background threads prepare microbatches ahead of the trainer
  int prefetch_min = 2;     // queue depth bounds; the depth adapts between them
  int prefetch_max = 8;
  int loader_threads = 2;
  double read_delay_ms = 0; // fault injection: every sample read takes this much longer (slow storage)
  bool verify = true;       // check every shard's checksum when training opens a dataset
};

struct MetricsConfig {
  std::string jsonl;          // per-step JSON lines; empty disables
  double peak_tflops = 0;     // MFU denominator per rank; 0 measures the sgemm rate at start
  int log_every = 1;          // progress line cadence when not on a terminal
  std::string job = "xirang";  // the job's name: the `job` label of exported metrics
  // Prometheus text endpoint /metrics on world rank 0 ("HOST:PORT"; empty: none),
  // and one per rank at PORT + local rank when prometheus_per_rank is set.
  std::string prometheus;
  bool prometheus_per_rank = false;
  // Straggler detection: every straggler_every steps (0: never) the ranks
  // exchange their step and compute times; a rank slower than
  // straggler_ratio x the median for straggler_checks checks in a row is named.
  int straggler_every = 0;
  double straggler_ratio = 1.3;
  int straggler_checks = 3;
  // A metrics.jsonl of an earlier run of the same config: tokens/s more than
  // baseline_tolerance below its median for baseline_steps steps in a row is flagged.
  std::string baseline;
  double baseline_tolerance = 0.1;
  int baseline_steps = 5;
  // Timeline traces: one Chrome trace-event JSON file per rank in `trace`
  // (empty: none) for steps trace_steps "A-B" (1-based, inclusive), written
  // when step B ends (or training does); see docs/observability.md.
  std::string trace;
  StepRange trace_steps{2, 4};  // "A-B" or "A" in the YAML, 1 <= A <= B
  // Time per kind of op (matmul, attention, ..., communication by group and
  // collective) per step, as metrics.jsonl's op_ms and op_calls.
  bool op_profile = false;
};

// Checkpoints (runtime/checkpoint/checkpoint_io.h): every `every` steps into `dir`,
// keeping the newest `keep`; resume = auto (the newest under dir, if any),
// none, or the path of a step directory (resume_path).
struct CheckpointConfig {
  std::string dir;             // empty: no checkpoints
  int every = 0;               // 0: only at the end of training (when dir is set)
  int keep = 3;
  ResumeMode resume = ResumeMode::Auto;
  std::string resume_path;     // resume = Path: the checkpoint step directory to load
  bool async = true;           // snapshot to host memory, write on a background thread while training goes on
  SaveErrorPolicy on_error = SaveErrorPolicy::Stop;  // a failed save: stop the run, or continue (warn and train on)
};

// Mixed precision: parameters and activations in `dtype` (fp32, bf16, fp16),
// with fp32 gradients, fp32 master weights and fp32 optimizer state under
// bf16/fp16. loss_scale: 0 is dynamic under fp16 (start at initial_scale,
// skip the step on an overflow and halve the scale, never below min_scale,
// once `hysteresis` overflows have come since it last grew; double it after
// growth_interval clean steps in a row) and off otherwise; a positive value
// is a fixed scale.
struct PrecisionConfig {
  Precision dtype = Precision::FP32;
  double loss_scale = 0;
  double initial_scale = 65536;
  int growth_interval = 1000;
  double min_scale = 1;
  int hysteresis = 1;  // Megatron-LM's default is 2
};

// Where the kernels run: cpu, or cuda (needs a CUDA build and a visible GPU).
struct DeviceConfig {
  Backend backend = Backend::CPU;
};

struct MemoryConfig {
  double limit_gb = 0;  // refuse to start when the plan exceeds this; 0 is no limit
};

struct Config {
  // The fields the chunks are built from (models/dims.h); model.preset
  // fills them first, the other model.* keys after it.
  ModelDims model;
  ParallelConfig parallel;
  TrainConfig train;
  DataConfig data;
  MetricsConfig metrics;
  MemoryConfig memory;
  PrecisionConfig precision;
  DeviceConfig device;
  CheckpointConfig checkpoint;
  CommConfig comm;
  FaultConfig faults;
  std::string source;  // the file it came from, for messages
  std::string yaml;    // the effective config (after overrides) as YAML, for logs and checkpoints

  int seq_len() const { return train.seq_len > 0 ? train.seq_len : model.max_seq_len; }
  // Microbatches per step on each dp rank: global_batch / (micro_batch * dp).
  int microbatches() const { return train.global_batch / (train.micro_batch * parallel.dp); }
};

// Reads `path`, applies "section.key=value" overrides in order, and returns
// the typed config (not yet validated). Throws ErrorKind::Config on a missing
// file, a YAML syntax error, an unknown key, or a value of the wrong type.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Same, from YAML text (tests).
Config parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides = {},
                    const std::string& source = "<string>");

// A config a run wrote (a checkpoint's meta.json): as parse_config, but a
// model.preset this build does not know stays a label, since the text
// spells out every model key.
Config parse_stored_config(const std::string& yaml_text, const std::string& source);

// Every key whose value is one of fixed spellings, with them in enum order
// ({"parallel.schedule", {"gpipe", "1f1b", "interleaved", "zb_h1"}}, ...):
// the schema's own list, for documentation and tests.
struct NamedKey {
  std::string key;
  std::vector<std::string> spellings;
};
std::vector<NamedKey> named_keys();

// Checks the config for a world of `world_size` ranks and fills inferred
// values (parallel.dp): first the rule of each key on its own (the schema's
// column, runtime/config/field_check.h) in schema order, then the rules
// between keys. Throws ErrorKind::Config naming key, value, rule.
void validate(Config& c, int world_size);
// "" or the rule that cutting sequences over parallel.cp and token rows over
// parallel.tp (sequence parallelism) breaks, as validate() reports it; the
// planner (analysis/plan) asks the same question of every layout it ranks.
std::string sharding_problem(const Config& c);

}  // namespace xirang
