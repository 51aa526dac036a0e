// analysis/plan/stage_cost.h: per-microbatch costs of one pipeline rank, the
// pieces analysis/plan/step_time.cc assembles into a step.
#pragma once

#include "analysis/plan/cost_model.h"

namespace xirang::analysis::plan {

// One pass over a piece of the model, per microbatch, on one device:
// compute (GEMMs, element-wise kernels, per-op overhead), exposed
// tensor-parallel collectives and context-parallel ones (all exposed: the
// trainer runs them on the compute stream's critical path).
struct PassCost {
  double compute = 0, tp_comm = 0, cp_comm = 0;
  double total() const { return compute + tp_comm + cp_comm; }
};

struct StageCost {
  PassCost fwd, bwd, rc;  // rc: the forward run again inside backward (recomputation)
  double fwd_total() const { return fwd.total(); }
  double bwd_total() const { return bwd.total() + rc.total(); }
};

// Per-microbatch costs of pipeline rank r (all its virtual-stage chunks).
StageCost stage_cost(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f, int r);
// The link a group of `size` ranks, `stride` apart, uses (ranks: tp fastest, then cp, then dp, then pp).
const Link& link_for(const Cluster& c, int stride, int size);
// Token rows of one microbatch on one rank: micro_batch x T / cp.
double rank_tokens(const Workload& w, const PlanLayout& l);
// Bytes of every cp rank's keys and values for one layer and microbatch, as
// gathered: B x T x 2 x (kv heads / tp) x head_dim x element size. A ring
// gather or reduce-scatter moves (cp-1)/cp of them through each rank's link.
double cp_kv_bytes(const Workload& w, const PlanLayout& l);
// The cp group's link: inside a node when its tp x cp ranks fit in one, else between nodes.
const Link& cp_link(const Cluster& c, const PlanLayout& l);
// One layer's key/value all-gather, and its gradients' reduce-scatter, one microbatch (0 at cp = 1).
double cp_gather_s(const Workload& w, const PlanLayout& l, const Cluster& c);
double cp_reduce_scatter_s(const Workload& w, const PlanLayout& l, const Cluster& c);
// Between neighbouring pipeline stages.
const Link& link_between_stages(const Cluster& c, const PlanLayout& l);
// Parameters on the first pipeline rank of one tp rank (it also holds the embeddings).
double local_params(const Workload& w, const PlanLayout& l);

}  // namespace xirang::analysis::plan
