// analysis/plan/cost_model.h: predicted memory and step time of one layout.
//
// The workload is a training config (model shape, sequence, global batch,
// precision, gradient buckets); the layout says how N devices split it.
// Memory comes from runtime/memory_estimate.h (the trainer's own arena
// sizes) plus an analytic term for recomputation, which the trainer does
// not implement yet. Time is a sum of terms, each from the model's FLOPs or
// bytes and a cluster constant (docs/performance_model.md has every
// formula); the pipeline's bubble and exposed transfers come from running
// runtime/schedule's simulator with the per-microbatch stage costs.
// Context parallelism (cp) gives each rank T / cp rows of every sequence:
// its compute and tp traffic shrink by cp, and it pays the key/value
// all-gathers and reduce-scatter of models/layers/cp_comm.h, exposed.
//
//   Workload w = workload_of(cfg);          // cfg: a loaded config
//   PlanLayout l;  l.tp = 8;  l.cp = 2;  l.pp = 4;  l.dp = 16;  l.micro_batch = 2;  l.recompute = Recompute::Full;
//   Prediction p = predict(w, l, cluster, {});
//   p.time.step_s;  p.tokens_per_s;  p.memory.total();
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/arena.h"
#include "runtime/config/config.h"
#include "analysis/plan/cluster.h"

namespace xirang::analysis::plan {

// Ranks are numbered tp fastest, then cp, then dp, then pp (the trainer's groups).
struct PlanLayout {
  int dp = 1, tp = 1, pp = 1, virtual_stages = 1, micro_batch = 1, zero = 0;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::None;  // train.recompute
  int cp = 1;                             // parallel.cp: ranks sharing each sequence
  int devices() const { return dp * cp * tp * pp; }
  // "dp=4,tp=2,pp=2,virtual_stages=1,micro_batch=2,zero=0,sequence_parallel=0,recompute=none" (",cp=C" after dp when cp > 1)
  std::string str() const;
};
// Parses "tp=2,pp=4,..." over `base` (keys not named keep their value); a Usage error names a bad key or value.
PlanLayout parse_layout(const std::string& text, PlanLayout base);

// What the runtime is assumed to overlap beyond what Xirang does today.
struct Features {
  bool tp_comm_overlap = false;       // tensor-parallel collectives pipelined with the GEMMs
  bool param_gather_overlap = false;  // ZeRO's parameter all-gather behind the next forward
};

// The model and batch, as the config gives them.
struct Workload {
  Config cfg;                      // model.*, train.global_batch, train.seq_len, precision, parallel.bucket_mb
  double layer_flops_per_token = 0;  // forward + backward of one transformer layer, from the model
  double head_flops_per_token = 0;   // the rest (embedding, head, loss), forward + backward
  double attention_flops_per_token = 0;  // one layer's attention core (q k^T, then times v), forward only
  double ffn_width = 0;              // the MLP's hidden width (model.ffn_hidden, else 4 d_model)
  double layer_params = 0;           // one transformer layer's parameters (whole, before tp)
  double ends_params = 0;            // the embeddings, or the final norm and the (tied) head table
  int tokens_per_sequence() const { return cfg.seq_len(); }
};
// From a loaded config: the model's FLOPs per token split into layers and the rest (ModelChunk::flops_per_token).
Workload workload_of(const Config& cfg);

// Seconds per step, by term (docs/performance_model.md).
struct StepTime {
  double forward_s = 0, backward_s = 0, recompute_s = 0;  // compute on the busiest stage, all microbatches
  double first_stage_compute_s = 0;  // forward + backward + recompute of pipeline stage 0 (what rank 0 measures)
  double tp_comm_s = 0;           // exposed tensor-parallel collectives (inside forward/backward above? no: separate)
  double cp_comm_s = 0;           // context-parallel key/value gathers and gradient reduce-scatters (never overlapped)
  double pp_bubble_s = 0;         // idle pipeline time (simulator, transfers free)
  double pp_comm_exposed_s = 0;   // what the transfers add to the simulated pipeline
  double dp_comm_s = 0;           // the data-parallel reduction's full duration
  double dp_comm_exposed_s = 0;   // the part the backward does not hide (+ ZeRO gather)
  double optimizer_s = 0;
  double data_wait_s = 0;
  double step_s = 0;
  std::vector<std::pair<std::string, std::string>> notes;  // term -> how it was computed (--explain)
};

struct Prediction {
  PlanLayout layout;
  StepTime time;
  MemoryPlan memory;  // per device, the largest pipeline stage
  size_t memory_total = 0;
  bool memory_known = false;
  bool fits = false;
  double tokens_per_s = 0;
  double model_tflops = 0;     // the model's FLOPs (ModelChunk::flops_per_token) per second per device
  double hardware_tflops = 0;  // including recomputation's extra forward
  double mfu = 0;              // model_tflops / peak
  std::string problem;         // why the layout cannot run ("" when it can)
};

// The rule `l` breaks for this workload and cluster ("" if none): the
// model's check_layout, batch divisibility, schedule rules, tp within a node,
// and the config's sharding rules for cp and sequence parallelism (sharding_problem).
std::string layout_problem(const Workload& w, const PlanLayout& l, const Cluster& c);
// Time only (fast; the search ranks by it).
Prediction predict_time(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f);
// predict_time's step less the pipeline's bubble and exposed transfers (the
// simulator's terms, never negative): a bound the search prunes with.
double step_lower_bound(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f);
// Adds memory per device (the trainer's plan for the largest stage, plus recomputation and buffers) and fit.
void add_memory(const Workload& w, const Cluster& c, Prediction& p);
Prediction predict(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f);

// The config the trainer would run for `l` (parallel.*, train.micro_batch; the config's parallel.cp_split kept).
Config layout_config(const Workload& w, const PlanLayout& l);

}  // namespace xirang::analysis::plan
