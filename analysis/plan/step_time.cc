// The step's timeline: per-stage costs through the schedule simulator, then
// the data-parallel reduction, the optimizer, and memory per device.
#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "core/error.h"
#include "analysis/format.h"
#include "runtime/memory_estimate.h"
#include "runtime/step/schedule.h"
#include "analysis/plan/collectives.h"
#include "analysis/plan/cost_model.h"
#include "analysis/plan/stage_cost.h"

namespace xirang::analysis::plan {

namespace {

// Simulations repeat across layouts with the same pipeline and costs.
SimResult simulate_cached(ScheduleKind k, int p, int m, int v, const SimCosts& costs) {
  static std::map<std::string, SimResult> cache;
  std::ostringstream key;
  key.precision(6);
  key << int(k) << '/' << p << '/' << m << '/' << v << '/' << costs.transfer << '/' << costs.weight_share;
  for (size_t i = 0; i < costs.forward_per_rank.size(); ++i)
    key << '/' << costs.forward_per_rank[i] << ':' << costs.backward_per_rank[i];
  auto it = cache.find(key.str());
  if (it != cache.end()) return it->second;
  SimResult r = simulate(k, p, m, v, costs);
  if (!r.ok) fail(ErrorKind::Internal, "schedule simulation failed: ", r.error);
  if (cache.size() > 20000) cache.clear();
  return cache.emplace(key.str(), r).first->second;
}

// The pipeline rank with the most forward + backward per microbatch (the first of equals).
int busiest_stage(const std::vector<StageCost>& stages) {
  int busiest = 0;
  for (int r = 1; r < int(stages.size()); ++r)
    if (stages[size_t(r)].fwd_total() + stages[size_t(r)].bwd_total() >
        stages[size_t(busiest)].fwd_total() + stages[size_t(busiest)].bwd_total())
      busiest = r;
  return busiest;
}

// The busiest pipeline stage's compute and collectives over the step's
// microbatches (no simulation); `stages` gets every rank's per-microbatch costs.
void stage_terms(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f, StepTime& t,
                 std::vector<StageCost>& stages) {
  const int m = w.cfg.train.global_batch / (l.micro_batch * l.dp);
  for (int r = 0; r < l.pp; ++r) stages.push_back(stage_cost(w, l, c, f, r));
  const StageCost& s = stages[size_t(busiest_stage(stages))];
  t.forward_s = m * s.fwd.compute;
  t.backward_s = m * s.bwd.compute;
  t.recompute_s = m * s.rc.compute;
  t.first_stage_compute_s = m * (stages.front().fwd.compute + stages.front().bwd.compute + stages.front().rc.compute);
  t.tp_comm_s = m * (s.fwd.tp_comm + s.bwd.tp_comm + s.rc.tp_comm);
  t.cp_comm_s = m * (s.fwd.cp_comm + s.bwd.cp_comm + s.rc.cp_comm);
  if (l.cp > 1) {
    const Link& link = cp_link(c, l);
    const int gathers = 2 + (l.recompute != Recompute::None);
    t.notes.push_back({"cp comm", format("%.4g MB of keys and values per layer and microbatch over %d ranks (%s): "
                                         "%d all-gathers %.4g ms each, 1 reduce-scatter %.4g ms",
                                         cp_kv_bytes(w, l) / 1e6, l.cp, &link == &c.intra_node ? "intra-node" : "inter-node",
                                         gathers, cp_gather_s(w, l, c) * 1e3, cp_reduce_scatter_s(w, l, c) * 1e3)});
  }
}

// The pipeline's bubble and exposed transfers: the simulator over the stages' costs.
void pipeline_terms(const Workload& w, const PlanLayout& l, const Cluster& c, StepTime& t,
                    const std::vector<StageCost>& stages) {
  const int p = l.pp, m = w.cfg.train.global_batch / (l.micro_batch * l.dp);
  SimCosts costs;
  for (int r = 0; r < p; ++r) {
    costs.forward_per_rank.push_back(stages[size_t(r)].fwd_total());
    costs.backward_per_rank.push_back(stages[size_t(r)].bwd_total());
  }
  const int busiest = busiest_stage(stages);
  const ScheduleKind kind = layout_config(w, l).parallel.schedule;
  // A split backward's weight part: the layers' weight-gradient products,
  // as many FLOPs as their forward products (M per token); the backward is
  // 2 (M + A) with A the attention core's forward, whose backward is all
  // input gradient. The layer's FLOPs per token are 3 (M + A), so the share
  // is M / (2 (M + A)). (Recomputation and the backward's collectives are
  // in the input part: the share of a whole stage's backward is a little less.)
  const double matrix = w.layer_flops_per_token / 3 - w.attention_flops_per_token;
  costs.weight_share = matrix / (2 * w.layer_flops_per_token / 3);
  const double n = rank_tokens(w, l);
  const double msg = n * w.cfg.model.d_model * (w.cfg.precision.dtype == Precision::FP32 ? 4 : 2) /
                     (l.sequence_parallel ? l.tp : 1);
  costs.transfer = 0;
  const SimResult free = simulate_cached(kind, p, m, l.virtual_stages, costs);
  costs.transfer = p > 1 ? send_s(msg, link_between_stages(c, l)) : 0;
  const SimResult real = p > 1 ? simulate_cached(kind, p, m, l.virtual_stages, costs) : free;
  const double busy = *std::max_element(free.busy.begin(), free.busy.end());
  t.pp_bubble_s = free.makespan - busy;
  t.pp_comm_exposed_s = real.makespan - free.makespan;
  t.notes.push_back({"pipeline", str_cat(schedule_name(kind), ", ", m, " microbatches, v=", l.virtual_stages,
                                         ": simulated makespan ", format("%.4g s", real.makespan), ", busiest stage ",
                                         busiest, " busy ", format("%.4g s", busy))});
  if (kind == ScheduleKind::ZeroBubbleH1 || kind == ScheduleKind::ZeroBubbleH2)
    t.notes.push_back({schedule_name(kind), format("weight part W = %.4f of a backward", costs.weight_share)});
  t.notes.push_back({"pp transfer", format("%.4g MB per message, %.4g ms each", msg / 1e6, costs.transfer * 1e3)});
}

// The data-parallel reduction after (and during) the last backward, and ZeRO's parameter gather.
// Parameters are replicated over cp as over dp: the group is the dp x cp
// ranks of one tp and pp rank (tp apart: cp is next to tp in the rank order).
void dp_terms(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f,
              const std::vector<StageCost>& stages, StepTime& t) {
  const int g = l.dp * l.cp;
  if (g == 1) return;
  const bool wide = w.cfg.precision.dtype == Precision::FP32;
  const double gbytes = 4, pbytes = wide ? 4 : 2;
  const double local = local_params(w, l);
  const Link& link = link_for(c, l.tp, g);
  const double grads = l.zero ? reduce_scatter_s(local * gbytes, g, link) : all_reduce_s(local * gbytes, g, link);
  const double gather = l.zero ? all_gather_s(local * pbytes, g, link) : 0;
  const double bucket_bytes = std::min(local * gbytes, w.cfg.parallel.bucket_mb * 1024 * 1024);
  const double bucket = l.zero ? reduce_scatter_s(bucket_bytes, g, link) : all_reduce_s(bucket_bytes, g, link);
  // Buckets start during the last microbatch's backward on the first stage (the last work of the step).
  const double window = w.cfg.parallel.overlap_grad_reduce ? stages.front().bwd_total() : 0;
  const double grads_exposed = window > 0 ? std::max(std::min(bucket, grads), grads - window) : grads;
  const double gather_exposed = f.param_gather_overlap ? std::max(0.0, gather - stages.front().fwd_total()) : gather;
  // The reduction cannot finish before the slowest rank's last gradients.
  const double skew = c.rank_skew * (t.forward_s + t.backward_s + t.recompute_s + t.tp_comm_s + t.cp_comm_s);
  t.dp_comm_s = grads + gather;
  t.dp_comm_exposed_s = grads_exposed + gather_exposed + skew;
  t.notes.push_back({"dp comm", format("%.4g M params x 4 B over %d ranks%s: %.4g ms", local / 1e6, g,
                                       l.cp > 1 ? " (dp x cp)" : "", (grads + gather) * 1e3)});
}

// AdamW: memory-bound over this rank's (shard of the) parameters, plus the gradient norm and zeroing.
void optimizer_term(const Workload& w, const PlanLayout& l, const Cluster& c, StepTime& t) {
  const bool wide = w.cfg.precision.dtype == Precision::FP32;
  const double local = local_params(w, l), updated = local / (l.zero ? l.dp * l.cp : 1);  // ZeRO shards over dp x cp
  // grad read; m, v read+write; param (and fp32 master under 16-bit) read+write.
  const double per_elem = wide ? 4 + 16 + 8 : 4 + 16 + 8 + 4;
  t.optimizer_s = c.memory_seconds(updated * per_elem + local * 8) +
                  c.op_overhead_us * 1e-6 * w.cfg.model.n_layer / l.pp;
}

}  // namespace

Prediction predict_time(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f) {
  Prediction p;
  p.layout = l;
  p.problem = layout_problem(w, l, c);
  if (!p.problem.empty()) return p;
  StepTime& t = p.time;
  std::vector<StageCost> stages;
  stage_terms(w, l, c, f, t, stages);
  pipeline_terms(w, l, c, t, stages);
  dp_terms(w, l, c, f, stages, t);
  optimizer_term(w, l, c, t);
  t.step_s = t.forward_s + t.backward_s + t.recompute_s + t.tp_comm_s + t.cp_comm_s + t.pp_bubble_s + t.pp_comm_exposed_s +
             t.dp_comm_exposed_s + t.optimizer_s + t.data_wait_s;
  const double tokens = double(w.cfg.train.global_batch) * w.cfg.seq_len();
  const double L = w.cfg.model.n_layer;
  const double model_flops = tokens * (L * w.layer_flops_per_token + w.head_flops_per_token);
  const double rc_flops = l.recompute == Recompute::Full        ? w.layer_flops_per_token / 3
                          : l.recompute == Recompute::Selective ? w.attention_flops_per_token
                                                                : 0;
  const double hw_flops = model_flops + tokens * L * rc_flops;
  p.tokens_per_s = tokens / t.step_s;
  p.model_tflops = model_flops / t.step_s / l.devices() / 1e12;
  p.hardware_tflops = hw_flops / t.step_s / l.devices() / 1e12;
  const double peak = w.cfg.precision.dtype == Precision::FP32 && c.peak_tflops_fp32 > 0 ? c.peak_tflops_fp32 : c.peak_tflops;
  p.mfu = p.model_tflops / peak;
  return p;
}

double step_lower_bound(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f) {
  StepTime t;
  std::vector<StageCost> stages;
  stage_terms(w, l, c, f, t, stages);
  dp_terms(w, l, c, f, stages, t);
  optimizer_term(w, l, c, t);
  return t.forward_s + t.backward_s + t.recompute_s + t.tp_comm_s + t.cp_comm_s + t.dp_comm_exposed_s + t.optimizer_s +
         t.data_wait_s;
}

void add_memory(const Workload& w, const Cluster& c, Prediction& p) {
  if (!p.problem.empty()) return;
  const PlanLayout& l = p.layout;
  const Config cfg = layout_config(w, l);
  int rank = 0;
  const MemoryPlan trainer = estimate_peak_memory(cfg, &rank);
  // layout_config sets train.recompute: the activations are the trainer's own accounting for that mode.
  MemoryPlan plan;
  for (const auto& item : trainer.items()) plan.add(item.category, item.bytes, item.detail);
  const int groups = (l.dp * l.cp > 1) + (l.cp > 1) + (l.tp > 1) + (l.pp > 1);
  if (groups > 0 && c.comm_buffer_mb > 0)
    plan.add("communication buffers", size_t(groups * c.comm_buffer_mb * 1e6), "per group with more than one rank");
  p.memory = plan;
  p.memory_total = plan.total();
  p.memory_known = true;
  p.fits = double(p.memory_total) <= c.usable_memory_bytes();
}

Prediction predict(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f) {
  Prediction p = predict_time(w, l, c, f);
  add_memory(w, c, p);
  return p;
}

}  // namespace xirang::analysis::plan
