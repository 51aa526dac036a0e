// runtime/config/validate.cc: the rules between fields, one function per
// subsystem. validate() first checks each key's rule on its own (the
// schema's column, field_check.h) in schema order, then applies these in a
// fixed order; the first broken rule is the one reported (the tests pin
// that order); every message names the key, the value and the rule.
#include <filesystem>
#include <string>

#include "core/error.h"
#include "runtime/config/config.h"
#include "runtime/config/config_text.h"
#include "runtime/config/field_check.h"
#include "runtime/config/model_layout.h"
#include "runtime/config/schedule_rules.h"

namespace xirang {
namespace {

class Validator {
 public:
  explicit Validator(const Config& c) : prefix_(c.source.empty() ? "" : c.source + ": ") {}

  [[noreturn]] void fail_rule(const std::string& msg) const { config_fail(prefix_ + msg); }
  void check(const std::string& problem) const {
    if (!problem.empty()) fail_rule(problem);
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
  if (m.head_dim == 0 && m.d_model % m.n_head != 0)
    v.fail_rule(str_cat("model.d_model=", m.d_model, " is not divisible by model.n_head=", m.n_head));
  // n_kv_head dividing n_head is layout_problem()'s (models/model.cc): every layout needs it.
  // The architecture's own keys (models/model.h's KeyRule): it states the rules, the words are field_check's.
  for (const KeyRule& r : model_arch(m.arch).key_rules(m)) {
    using K = KeyRule::Kind;
    const char* key = r.key.c_str();
    switch (r.kind) {
      case K::AtLeast: v.check(field_problem(AtLeast{r.bound, r.why.c_str()}, key, int64_t(r.value))); break;
      case K::Positive: v.check(field_problem(Positive, key, r.value)); break;
      case K::NonNegative: v.check(field_problem(AtLeast{0, r.why.c_str()}, key, r.value)); break;
      case K::Above: v.check(field_problem(Above{r.bound}, key, r.value)); break;
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
  if (t.seq_len > m.max_seq_len)
    v.fail_rule(str_cat("train.seq_len=", t.seq_len, " exceeds model.seq_len=", m.max_seq_len,
                        " (the size of the position table)"));
}

// world = dp x cp x tp x pp, with dp inferred when 0.
void check_world(const Validator& v, ParallelConfig& p, int world_size) {
  const int64_t model_ranks = int64_t{p.cp} * p.tp * p.pp;
  // cp is named only where it is used, so the messages of other layouts read as before it.
  const std::string cp = p.cp > 1 ? str_cat("parallel.cp (", p.cp, ") x ") : "";
  if (p.dp == 0) {
    if (world_size % model_ranks != 0)
      v.fail_rule(str_cat("world size ", world_size, " is not divisible by ", cp, "parallel.tp (", p.tp,
                          ") x parallel.pp (", p.pp, ") = ", model_ranks, ", so parallel.dp cannot be inferred"));
    p.dp = static_cast<int>(world_size / model_ranks);
  }
  if (int64_t{p.dp} * model_ranks != world_size)
    v.fail_rule(str_cat("world size ", world_size, " != parallel.dp (", p.dp, ") x ", cp, "parallel.tp (", p.tp,
                        ") x parallel.pp (", p.pp, ")"));
  // ep lives inside dp. Whether the model has experts to shard is the
  // model's rule (its key_rules), once the decoder has an MoE role.
  if (p.dp % p.ep != 0)
    v.fail_rule(str_cat("parallel.ep=", p.ep, " does not divide parallel.dp=", p.dp,
                        ": expert parallelism shards the experts over ep of the data-parallel ranks"));
}

// The pipeline: what the layout must split evenly, the schedule's needs.
void check_pipeline(const Validator& v, const Config& c) {
  const ParallelConfig& p = c.parallel;
  const TrainConfig& t = c.train;
  // What the layout must split evenly (heads, vocabulary, layers), stated once for every architecture.
  v.check(layout_problem(c.model, parallel_layout(p)));
  const int64_t per_micro = int64_t{t.micro_batch} * p.dp;
  if (t.global_batch % per_micro != 0)
    v.fail_rule(str_cat("train.global_batch=", t.global_batch, " is not divisible by train.micro_batch (",
                        t.micro_batch, ") x parallel.dp (", p.dp, ")"));
  const int m = static_cast<int>(t.global_batch / per_micro);
  v.check(executor_problem(p.schedule, c.comm.ordered_p2p, c.device.backend, p.cp));
  v.check(schedule_problem(p.schedule, p.pp, p.virtual_stages, m,
                           str_cat("train.global_batch ", t.global_batch, " / (train.micro_batch ", t.micro_batch,
                                   " x parallel.dp ", p.dp, ") = ", m)));
}

void check_bounds(const Validator& v, const Config& c) {
  if (c.data.prefetch_max < c.data.prefetch_min)
    v.fail_rule(str_cat("data.prefetch_max=", c.data.prefetch_max, " is below data.prefetch_min=", c.data.prefetch_min));
  const PrecisionConfig& pc = c.precision;
  if (pc.min_scale > pc.initial_scale)
    v.fail_rule(str_cat("precision.min_scale=", pc.min_scale, " is above precision.initial_scale=", pc.initial_scale));
}

void check_faults(const Validator& v, FaultConfig& f, int world_size) {
  if (f.kind == FaultKind::None) return;
  if (f.rank < 0 || f.rank >= world_size)
    v.fail_rule(str_cat("faults.rank=", f.rank, " is not a rank of this world (0..", world_size - 1, ")"));
  // A slow device is slow from the start: slow_rank's step defaults to 1.
  if (f.kind == FaultKind::SlowRank && f.step == 0) f.step = 1;
  v.check(field_problem(AtLeast{1}, "faults.step", int64_t{f.step}));  // 0 (unset) is fine without a fault
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

// Context parallelism cuts each sequence into 2 x cp chunks (kernels/context_split.h);
// sequence parallelism splits a microbatch's token rows (a cp rank's) over tp.
std::string sharding_problem(const Config& c) {
  const ParallelConfig& p = c.parallel;
  if (p.cp > 1 && c.seq_len() % (2 * p.cp) != 0)
    return str_cat(c.train.seq_len > 0 ? "train.seq_len=" : "model.seq_len=", c.seq_len(),
                   " is not divisible by 2 x parallel.cp (", p.cp, ") = ", 2 * p.cp,
                   ": context parallelism cuts each sequence into 2 x cp equal chunks");
  if (p.sequence_parallel) {
    const int64_t local = c.seq_len() / p.cp, rows = int64_t{c.train.micro_batch} * local;
    if (rows % p.tp != 0)
      return str_cat("parallel.sequence_parallel splits the ", rows, " token rows of a microbatch (train.micro_batch ",
                     c.train.micro_batch, " x seq_len ", c.seq_len(), p.cp > 1 ? str_cat(" / parallel.cp ", p.cp) : "",
                     ") over parallel.tp=", p.tp, ", which does not divide them");
  }
  return "";
}

void validate(Config& c, int world_size) {
  const Validator v(c);
  if (world_size < 1) v.fail_rule(str_cat("world size ", world_size, " must be >= 1"));
  v.check(first_field_problem(c));
  check_model(v, c.model);
  check_batch(v, c.train, c.model);
  check_world(v, c.parallel, world_size);
  check_pipeline(v, c);
  v.check(sharding_problem(c));
  // The ring's block kernels are CPU code (kernels/cp_ring_attention.h).
  if (c.parallel.cp_comm == CpCommKind::Ring && c.device.backend == Backend::CUDA)
    v.fail_rule("parallel.cp_comm=ring runs on the CPU backend only (device.backend=cuda); "
                "use parallel.cp_comm=all_gather");
  check_bounds(v, c);
  check_faults(v, c.faults, world_size);
  check_datasets(v, c);
}

}  // namespace xirang
