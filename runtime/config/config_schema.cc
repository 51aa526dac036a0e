#include "runtime/config/config_schema.h"

#include "models/model.h"
#include "runtime/config/config_text.h"

namespace xirang {
namespace {

// "" when model.arch names an architecture of the registry (models/model.h).
std::string arch_problem(std::string_view key, const std::string& arch) {
  return model_arch_known(arch) ? ""
                                : str_cat(key, "='", arch, "' is not supported (supported: ", model_arch_names(), ")");
}

}  // namespace

// The third column is the rule the value meets on its own (field_check.h).
std::vector<Section> schema(Config& c) {
  ModelDims& m = c.model;
  RopeScaling& rs = m.rope.scaling;
  MoeDims& moe = m.moe;
  ParallelConfig& p = c.parallel;
  TrainConfig& t = c.train;
  DataConfig& d = c.data;
  MetricsConfig& mc = c.metrics;
  PrecisionConfig& pc = c.precision;
  CheckpointConfig& ck = c.checkpoint;
  return {
      {"model",
       {{"arch", &m.arch, TextRule{arch_problem}},
        {"preset", &m.preset},
        {"n_layer", &m.n_layer, AtLeast{1}},
        {"n_head", &m.n_head, AtLeast{1}},
        {"d_model", &m.d_model, AtLeast{1}},
        {"seq_len", &m.max_seq_len, AtLeast{1}},
        {"vocab_size", &m.vocab_size, AtLeast{1}},
        {"vocab_multiple", &m.vocab_multiple, AtLeast{1}},
        {"n_kv_head", &m.n_kv_head, AtLeast{0, " (0 means model.n_head)"}},
        {"head_dim", &m.head_dim, AtLeast{0, " (0 means model.d_model / model.n_head)"}},
        // The architecture's own keys are checked by its KeyRules (validate.cc).
        {"ffn_hidden", &m.ffn_hidden},
        {"ffn_multiple_of", &m.ffn_multiple_of},
        {"ffn_dim_multiplier", &m.ffn_dim_multiplier},
        {"rope_theta", &m.rope.theta},
        {"rope_scaling.type", &rs.type},
        {"rope_scaling.factor", &rs.factor},
        {"rope_scaling.low_freq_factor", &rs.low_freq_factor},
        {"rope_scaling.high_freq_factor", &rs.high_freq_factor},
        {"rope_scaling.original_max_position_embeddings", &rs.original_max_position_embeddings},
        {"norm_eps", &m.norm_eps},
        {"tie_embeddings", TieRef(&m.tie_embeddings)},
        // The mixture of experts (models/dims.h MoeDims); the architecture's key rules check the values.
        {"moe.num_experts", &moe.num_experts},
        {"moe.top_k", &moe.top_k},
        {"moe.expert_hidden", &moe.expert_hidden},
        {"moe.shared_hidden", &moe.shared_hidden},
        {"moe.score", &moe.score},
        {"moe.normalize", &moe.normalize},
        {"moe.bias_update_rate", &moe.bias_update_rate},
        {"moe.aux_loss", &moe.aux_loss},
        {"moe.aux_loss_coeff", &moe.aux_loss_coeff},
        {"moe.force_balance", &moe.force_balance}}},
      {"parallel",
       {{"dp", &p.dp, AtLeast{0, " (0 infers it from the world size)"}},
        {"tp", &p.tp, AtLeast{1}},
        {"pp", &p.pp, AtLeast{1}},
        {"cp", &p.cp, AtLeast{1}},
        {"cp_split", &p.cp_split},
        {"ep", &p.ep, AtLeast{1}},
        {"cp_comm", &p.cp_comm},
        {"zero", &p.zero, Within{0, 1}},
        {"bucket_mb", &p.bucket_mb, Positive},
        {"overlap_grad_reduce", &p.overlap_grad_reduce},
        {"sequence_parallel", &p.sequence_parallel},
        {"schedule", &p.schedule},
        {"virtual_stages", &p.virtual_stages, AtLeast{1}}}},
      {"train",
       {{"steps", &t.steps, AtLeast{1}},
        {"global_batch", &t.global_batch, AtLeast{1}},
        {"micro_batch", &t.micro_batch, AtLeast{1}},
        {"seq_len", &t.seq_len, AtLeast{0, " (0 means model.seq_len)"}},
        {"lr", &t.lr, Positive},
        {"min_lr_ratio", &t.min_lr_ratio, Within{0, 1}},
        {"warmup_steps", &t.warmup_steps, AtLeast{0}},
        {"weight_decay", &t.weight_decay, AtLeast{0}},
        {"beta1", &t.beta1, Within{0, 1, Ends::ClosedOpen}},
        {"beta2", &t.beta2, Within{0, 1, Ends::ClosedOpen}},
        {"eps", &t.eps, Positive},
        {"grad_clip", &t.grad_clip, AtLeast{0, " (0 disables clipping)"}},
        {"seed", &t.seed},
        {"eval_every", &t.eval_every, AtLeast{0, " (0 disables validation)"}},
        {"eval_batches", &t.eval_batches, AtLeast{1}},
        {"recompute", &t.recompute},
        {"stop_after", &t.stop_after, AtLeast{0, " (0 runs to train.steps)"}},
        {"max_nonfinite_steps", &t.max_nonfinite_steps, AtLeast{1, " (skipped steps in a row before the run stops)"}},
        {"skip_loss_spikes_zscore", &t.skip_loss_spikes_zscore, AtLeast{0, " (0 turns the loss-spike guard off)"}}}},
      {"data",
       {{"train", &d.train},  // validate.cc checks it last: the rules above need no filesystem
        {"val", &d.val},
        {"prefetch", &d.prefetch},
        {"prefetch_min", &d.prefetch_min, AtLeast{1}},
        {"prefetch_max", &d.prefetch_max},
        {"loader_threads", &d.loader_threads, AtLeast{1}},
        {"read_delay_ms", &d.read_delay_ms, AtLeast{0}},
        {"verify", &d.verify}}},
      {"metrics",
       {{"jsonl", &mc.jsonl},
        {"peak_tflops", &mc.peak_tflops, AtLeast{0, " (0 measures it at start)"}},
        {"log_every", &mc.log_every, AtLeast{1}},
        {"job", &mc.job, NotEmpty{"it names the job in exported metrics"}},
        {"prometheus", &mc.prometheus, TextRule{host_port_problem}},
        {"prometheus_per_rank", &mc.prometheus_per_rank},
        {"straggler_every", &mc.straggler_every, AtLeast{0, " (0 disables straggler detection)"}},
        {"straggler_ratio", &mc.straggler_ratio, Above{1}},
        {"straggler_checks", &mc.straggler_checks, AtLeast{1}},
        {"baseline", &mc.baseline},
        {"baseline_tolerance", &mc.baseline_tolerance, Within{0, 1, Ends::Open}},
        {"baseline_steps", &mc.baseline_steps, AtLeast{1}},
        {"trace", &mc.trace},
        {"trace_steps", &mc.trace_steps},
        {"op_profile", &mc.op_profile}}},
      {"memory", {{"limit_gb", &c.memory.limit_gb, AtLeast{0, " (0 is no limit)"}}}},
      {"precision",
       {{"dtype", &pc.dtype},
        {"loss_scale", &pc.loss_scale, AtLeast{0, " (0 is dynamic under fp16, off otherwise)"}},
        {"initial_scale", &pc.initial_scale, Positive},
        {"growth_interval", &pc.growth_interval, AtLeast{1}},
        {"min_scale", &pc.min_scale, Positive},
        {"hysteresis", &pc.hysteresis, AtLeast{1}}}},
      {"device", {{"backend", &c.device.backend}}},
      {"checkpoint",
       {{"dir", &ck.dir},
        {"every", &ck.every, AtLeast{0, " (0 saves only at the end)"}},
        {"keep", &ck.keep, AtLeast{1}},
        {"resume", ResumeRef{&ck.resume, &ck.resume_path},
         NotEmpty{"use auto, none, or the path of a checkpoint step directory"}},
        {"async", &ck.async},
        {"on_error", &ck.on_error}}},
      {"comm",
       {{"timeout_s", &c.comm.timeout_s, Positive},
        {"latency_us", &c.comm.latency_us, AtLeast{0}},
        {"bandwidth_gbps", &c.comm.bandwidth_gbps, AtLeast{0, " (0 is no limit)"}},
        {"ordered_p2p", &c.comm.ordered_p2p},
        {"nccl_alone", &c.comm.nccl_alone},
        {"busy_poll", &c.comm.busy_poll},
        {"trace_dir", &c.comm.trace_dir}}},
      {"faults",
       // faults.rank and faults.step depend on the kind and the world: validate.cc's.
       {{"kind", &c.faults.kind},
        {"rank", &c.faults.rank},
        {"step", &c.faults.step},
        {"delay_ms", &c.faults.delay_ms, AtLeast{0}},
        {"steps", &c.faults.steps, AtLeast{1}}}},
  };
}

// The rule of each row's third column, in schema order: the first broken one's message, or "".
std::string first_field_problem(const Config& config) {
  Config copy = config;  // schema() wants mutable fields; checking must not touch the caller's
  for (const Section& s : schema(copy))
    for (const Field& f : s.fields) {
      const std::string key = str_cat(s.name, ".", f.key);
      const std::string problem = std::visit(
          [&](auto p) -> std::string {
            using P = decltype(p);
            if constexpr (std::is_same_v<P, int*>) return field_problem(f.check, key, int64_t{*p});
            else if constexpr (std::is_same_v<P, double*>) return field_problem(f.check, key, *p);
            else if constexpr (std::is_same_v<P, std::string*>) return field_problem(f.check, key, *p);
            else if constexpr (std::is_same_v<P, ResumeRef>) return field_problem(f.check, key, spelling(p));
            else {
              XR_CHECK(std::holds_alternative<std::monostate>(f.check), "config schema: ", key,
                       " has a rule its kind of value cannot meet");
              return "";
            }
          },
          f.ptr);
      if (!problem.empty()) return problem;
    }
  return "";
}

std::vector<NamedKey> named_keys() {
  Config c;
  std::vector<NamedKey> out;
  for (const Section& s : schema(c))
    for (const Field& f : s.fields) {
      std::span<const char* const> names;
      if (const NamedRef* r = std::get_if<NamedRef>(&f.ptr)) names = r->names;
      else if (std::holds_alternative<TieRef>(f.ptr)) names = kTieNames;
      else continue;
      out.push_back({str_cat(s.name, ".", f.key), {names.begin(), names.end()}});
    }
  return out;
}

}  // namespace xirang
