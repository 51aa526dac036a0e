// runtime/config/validate.cc: the rules between fields, one function per
// subsystem. validate() applies them in a fixed order and the first broken
// rule is the one reported (the tests pin that order); every message names
// the key, the value and the rule.
#include <filesystem>
#include <string>

#include "core/error.h"
#include "runtime/config/config.h"
#include "runtime/config/config_text.h"
#include "runtime/config/model_layout.h"

namespace xirang {
namespace {

class Validator {
 public:
  explicit Validator(const Config& c) : prefix_(c.source.empty() ? "" : c.source + ": ") {}

  [[noreturn]] void fail_rule(const std::string& msg) const { config_fail(prefix_ + msg); }

  void at_least(const char* key, int64_t v, int64_t min, const char* why = "") const {
    if (v < min) fail_rule(str_cat(key, "=", v, " must be >= ", min, why));
  }
  // Written as !(ok) so that a NaN set from code fails too.
  void positive(const char* key, double v) const {
    if (!(v > 0)) fail_rule(str_cat(key, "=", format_double(v), " must be > 0"));
  }
  void non_negative(const char* key, double v, const char* why = "") const {
    if (!(v >= 0)) fail_rule(str_cat(key, "=", format_double(v), " must be >= 0", why));
  }
  void half_open_unit(const char* key, double v) const {
    if (!(v >= 0 && v < 1)) fail_rule(str_cat(key, "=", format_double(v), " must be in [0, 1)"));
  }
  void divisible(const char* key, int64_t v, const char* by_key, int64_t by) const {
    if (v % by != 0) fail_rule(str_cat(key, "=", v, " is not divisible by ", by_key, "=", by));
  }

  // A split directory is what `xirang data prepare` writes: index.json plus shards.
  void dataset(const char* key, const std::string& dir) const {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      fail_rule(str_cat(key, "='", dir, "': no such directory (write one with `xirang data prepare`)"));
    fs::path index = fs::path(dir) / "index.json";
    if (!fs::is_regular_file(index, ec))
      fail_rule(str_cat(key, "='", dir, "': no dataset there (missing ", index.string(), ")"));
  }

 private:
  std::string prefix_;
};

void check_model(const Validator& v, const ModelDims& m) {
  if (!model_arch_known(m.arch))
    v.fail_rule(str_cat("model.arch='", m.arch, "' is not supported (supported: ", model_arch_names(), ")"));
  v.at_least("model.n_layer", m.n_layer, 1);
  v.at_least("model.n_head", m.n_head, 1);
  v.at_least("model.d_model", m.d_model, 1);
  v.at_least("model.seq_len", m.max_seq_len, 1);
  v.at_least("model.vocab_size", m.vocab_size, 1);
  v.at_least("model.vocab_multiple", m.vocab_multiple, 1);
  v.at_least("model.head_dim", m.head_dim, 0, " (0 means model.d_model / model.n_head)");
  if (m.head_dim == 0) v.divisible("model.d_model", m.d_model, "model.n_head", m.n_head);
  v.at_least("model.n_kv_head", m.n_kv_head, 0, " (0 means model.n_head)");
  // n_kv_head dividing n_head is layout_problem()'s (models/model.cc): every layout needs it.
  // The architecture's own keys (models/model.h's KeyRule): it states the rules, the words are ours.
  for (const KeyRule& r : model_arch(m.arch).key_rules(m)) {
    using K = KeyRule::Kind;
    const char* key = r.key.c_str();
    switch (r.kind) {
      case K::AtLeast: v.at_least(key, int64_t(r.value), int64_t(r.bound), r.why.c_str()); break;
      case K::Positive: v.positive(key, r.value); break;
      case K::NonNegative: v.non_negative(key, r.value, r.why.c_str()); break;
      case K::Above:
        if (!(r.value > r.bound))
          v.fail_rule(str_cat(key, "=", format_double(r.value), " must be > ", r.bound));
        break;
      case K::BelowOther:
        if (!(r.value < r.other_value))
          v.fail_rule(str_cat(r.other, "=", format_double(r.other_value), " must be above ", key, "=",
                              format_double(r.value)));
        break;
      case K::Refused: v.fail_rule(r.why);
    }
  }
}

void check_batch(const Validator& v, const TrainConfig& t, const ModelDims& m) {
  v.at_least("train.steps", t.steps, 1);
  v.at_least("train.global_batch", t.global_batch, 1);
  v.at_least("train.micro_batch", t.micro_batch, 1);
  v.at_least("train.seq_len", t.seq_len, 0, " (0 means model.seq_len)");
  if (t.seq_len > m.max_seq_len)
    v.fail_rule(str_cat("train.seq_len=", t.seq_len, " exceeds model.seq_len=", m.max_seq_len,
                        " (the size of the position table)"));
}

// world = dp x tp x pp, with dp inferred when 0.
void check_world(const Validator& v, ParallelConfig& p, int world_size) {
  if (world_size < 1) v.fail_rule(str_cat("world size ", world_size, " must be >= 1"));
  v.at_least("parallel.tp", p.tp, 1);
  v.at_least("parallel.pp", p.pp, 1);
  v.at_least("parallel.dp", p.dp, 0, " (0 infers it from the world size)");
  const int64_t model_ranks = int64_t{p.tp} * p.pp;
  if (p.dp == 0) {
    if (world_size % model_ranks != 0)
      v.fail_rule(str_cat("world size ", world_size, " is not divisible by parallel.tp (", p.tp,
                          ") x parallel.pp (", p.pp, ") = ", model_ranks, ", so parallel.dp cannot be inferred"));
    p.dp = static_cast<int>(world_size / model_ranks);
  }
  if (int64_t{p.dp} * model_ranks != world_size)
    v.fail_rule(str_cat("world size ", world_size, " != parallel.dp (", p.dp, ") x parallel.tp (", p.tp,
                        ") x parallel.pp (", p.pp, ")"));
}

// The pipeline: what the layout must split evenly, the schedule's needs.
void check_pipeline(const Validator& v, const Config& c) {
  const ParallelConfig& p = c.parallel;
  const TrainConfig& t = c.train;
  v.at_least("parallel.virtual_stages", p.virtual_stages, 1);
  const ScheduleKind kind = p.schedule;
  // What the layout must split evenly (heads, vocabulary, layers), stated once for every architecture.
  if (const std::string problem = layout_problem(c.model, parallel_layout(p)); !problem.empty())
    v.fail_rule(problem);
  if (kind != ScheduleKind::Interleaved && p.virtual_stages != 1)
    v.fail_rule(str_cat("parallel.virtual_stages=", p.virtual_stages, " needs parallel.schedule=interleaved (got ",
                        schedule_name(p.schedule), ")"));
  if (kind == ScheduleKind::Interleaved && p.virtual_stages < 2)
    v.fail_rule("parallel.schedule=interleaved needs parallel.virtual_stages >= 2");
  if (kind == ScheduleKind::ZeroBubbleH1 && p.pp < 2)
    v.fail_rule("parallel.schedule=zb_h1 needs parallel.pp >= 2 (one stage has no bubble for the split backward to fill)");

  const int64_t per_micro = int64_t{t.micro_batch} * p.dp;
  if (t.global_batch % per_micro != 0)
    v.fail_rule(str_cat("train.global_batch=", t.global_batch, " is not divisible by train.micro_batch (",
                        t.micro_batch, ") x parallel.dp (", p.dp, ")"));
  if (kind == ScheduleKind::Interleaved && (t.global_batch / per_micro) % p.pp != 0)
    v.fail_rule(str_cat("parallel.schedule=interleaved needs the microbatches per step (train.global_batch ",
                        t.global_batch, " / (train.micro_batch ", t.micro_batch, " x parallel.dp ", p.dp, ") = ",
                        t.global_batch / per_micro, ") to be a multiple of parallel.pp=", p.pp));
}

void check_optimizer(const Validator& v, const TrainConfig& t) {
  v.positive("train.lr", t.lr);
  v.at_least("train.warmup_steps", t.warmup_steps, 0);
  v.non_negative("train.weight_decay", t.weight_decay);
  v.half_open_unit("train.beta1", t.beta1);
  v.half_open_unit("train.beta2", t.beta2);
  v.positive("train.eps", t.eps);
  v.non_negative("train.grad_clip", t.grad_clip, " (0 disables clipping)");
  if (!(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1))
    v.fail_rule(str_cat("train.min_lr_ratio=", format_double(t.min_lr_ratio), " must be in [0, 1]"));
  v.at_least("train.eval_every", t.eval_every, 0, " (0 disables validation)");
  v.at_least("train.eval_batches", t.eval_batches, 1);
  v.at_least("train.stop_after", t.stop_after, 0, " (0 runs to train.steps)");
  v.non_negative("train.skip_loss_spikes_zscore", t.skip_loss_spikes_zscore, " (0 turns the loss-spike guard off)");
  v.at_least("train.max_nonfinite_steps", t.max_nonfinite_steps, 1, " (skipped steps in a row before the run stops)");
}

// "HOST:PORT" with a port in 1..65535.
void check_endpoint(const Validator& v, const char* key, const std::string& value) {
  const size_t colon = value.rfind(':');
  const std::string port = colon == std::string::npos ? "" : value.substr(colon + 1);
  const bool digits = !port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos;
  if (colon == 0 || !digits || std::stol(port) < 1 || std::stol(port) > 65535)
    v.fail_rule(str_cat(key, "='", value, "' is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9400)"));
}

void check_metrics_memory(const Validator& v, const Config& c) {
  const MetricsConfig& m = c.metrics;
  v.non_negative("metrics.peak_tflops", m.peak_tflops, " (0 measures it at start)");
  v.at_least("metrics.log_every", m.log_every, 1);
  if (m.job.empty()) v.fail_rule("metrics.job is empty: it names the job in exported metrics");
  if (!m.prometheus.empty()) check_endpoint(v, "metrics.prometheus", m.prometheus);
  v.at_least("metrics.straggler_every", m.straggler_every, 0, " (0 disables straggler detection)");
  if (!(m.straggler_ratio > 1))
    v.fail_rule(str_cat("metrics.straggler_ratio=", format_double(m.straggler_ratio), " must be > 1"));
  v.at_least("metrics.straggler_checks", m.straggler_checks, 1);
  if (!(m.baseline_tolerance > 0 && m.baseline_tolerance < 1))
    v.fail_rule(str_cat("metrics.baseline_tolerance=", format_double(m.baseline_tolerance), " must be in (0, 1)"));
  v.at_least("metrics.baseline_steps", m.baseline_steps, 1);
  v.non_negative("memory.limit_gb", c.memory.limit_gb, " (0 is no limit)");
}

// ZeRO, gradient buckets and sequence parallelism.
void check_sharding(const Validator& v, const Config& c) {
  const ParallelConfig& p = c.parallel;
  if (p.zero != 0 && p.zero != 1) v.fail_rule(str_cat("parallel.zero=", p.zero, " must be 0 or 1"));
  v.positive("parallel.bucket_mb", p.bucket_mb);
  if (p.sequence_parallel) {
    const int64_t rows = int64_t{c.train.micro_batch} * c.seq_len();
    if (rows % p.tp != 0)
      v.fail_rule(str_cat("parallel.sequence_parallel splits the ", rows, " token rows of a microbatch (train.micro_batch ",
                          c.train.micro_batch, " x seq_len ", c.seq_len(), ") over parallel.tp=", p.tp,
                          ", which does not divide them"));
  }
}

void check_loader(const Validator& v, const DataConfig& d) {
  v.at_least("data.prefetch_min", d.prefetch_min, 1);
  if (d.prefetch_max < d.prefetch_min)
    v.fail_rule(str_cat("data.prefetch_max=", d.prefetch_max, " is below data.prefetch_min=", d.prefetch_min));
  v.at_least("data.loader_threads", d.loader_threads, 1);
  v.non_negative("data.read_delay_ms", d.read_delay_ms);
}

void check_comm(const Validator& v, const CommConfig& cc) {
  v.positive("comm.timeout_s", cc.timeout_s);
  v.non_negative("comm.latency_us", cc.latency_us);
  v.non_negative("comm.bandwidth_gbps", cc.bandwidth_gbps, " (0 is no limit)");
}

void check_precision(const Validator& v, const PrecisionConfig& pc) {
  v.non_negative("precision.loss_scale", pc.loss_scale, " (0 is dynamic under fp16, off otherwise)");
  v.positive("precision.initial_scale", pc.initial_scale);
  v.at_least("precision.growth_interval", pc.growth_interval, 1);
  v.positive("precision.min_scale", pc.min_scale);
  v.at_least("precision.hysteresis", pc.hysteresis, 1);
  if (pc.min_scale > pc.initial_scale)
    v.fail_rule(str_cat("precision.min_scale=", pc.min_scale, " is above precision.initial_scale=", pc.initial_scale));
}

void check_checkpoint(const Validator& v, const CheckpointConfig& ck) {
  v.at_least("checkpoint.every", ck.every, 0, " (0 saves only at the end)");
  v.at_least("checkpoint.keep", ck.keep, 1);
  if (ck.resume == ResumeMode::Path && ck.resume_path.empty())
    v.fail_rule("checkpoint.resume is empty: use auto, none, or the path of a checkpoint step directory");
}

void check_faults(const Validator& v, FaultConfig& f, int world_size) {
  if (f.kind == FaultKind::None) return;
  if (f.rank < 0 || f.rank >= world_size)
    v.fail_rule(str_cat("faults.rank=", f.rank, " is not a rank of this world (0..", world_size - 1, ")"));
  // A slow device is slow from the start: slow_rank's step defaults to 1.
  if (f.kind == FaultKind::SlowRank && f.step == 0) f.step = 1;
  v.at_least("faults.step", f.step, 1);
  v.non_negative("faults.delay_ms", f.delay_ms);
  v.at_least("faults.steps", f.steps, 1);
  if (f.kind == FaultKind::SlowRank && !(f.delay_ms > 0))
    v.fail_rule("faults.kind=slow_rank needs faults.delay_ms > 0 (the extra compute time per step)");
}

// Last: the checks above need no filesystem.
void check_datasets(const Validator& v, const Config& c) {
  if (c.data.train.empty())
    v.fail_rule("data.train is empty: set it to a dataset directory written by `xirang data prepare`");
  v.dataset("data.train", c.data.train);
  if (!c.data.val.empty()) v.dataset("data.val", c.data.val);
  if (c.train.eval_every > 0 && c.data.val.empty())
    v.fail_rule(str_cat("train.eval_every=", c.train.eval_every,
                        " needs data.val (a validation split); set data.val or train.eval_every=0"));
}

}  // namespace

void validate(Config& c, int world_size) {
  const Validator v(c);
  check_model(v, c.model);
  check_batch(v, c.train, c.model);
  check_world(v, c.parallel, world_size);
  check_pipeline(v, c);
  check_optimizer(v, c.train);
  check_metrics_memory(v, c);
  check_sharding(v, c);
  check_loader(v, c.data);
  check_comm(v, c.comm);
  check_precision(v, c.precision);
  check_checkpoint(v, c.checkpoint);
  check_faults(v, c.faults, world_size);
  check_datasets(v, c);
}

}  // namespace xirang
