// analysis/plan/stage_cost.h: per-microbatch costs of one pipeline rank, the
// pieces analysis/plan/step_time.cc assembles into a step.
#pragma once

#include "analysis/plan/cost_model.h"

namespace xirang::analysis::plan {

// One pass over a piece of the model, per microbatch, on one device:
// compute (GEMMs, element-wise kernels, per-op overhead) and exposed
// tensor-parallel collectives.
struct PassCost {
  double compute = 0, tp_comm = 0;
  double total() const { return compute + tp_comm; }
};

struct StageCost {
  PassCost fwd, bwd, rc;  // rc: the forward run again inside backward (recomputation)
  double fwd_total() const { return fwd.total(); }
  double bwd_total() const { return bwd.total() + rc.total(); }
};

// Per-microbatch costs of pipeline rank r (all its virtual-stage chunks).
StageCost stage_cost(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f, int r);
// The link a group of `size` ranks, `stride` apart, uses (ranks: tp fastest, then dp, then pp).
const Link& link_for(const Cluster& c, int stride, int size);
// Between neighbouring pipeline stages.
const Link& link_between_stages(const Cluster& c, const PlanLayout& l);
// Parameters on the first pipeline rank of one tp rank (it also holds the embeddings).
double local_params(const Workload& w, const PlanLayout& l);

}  // namespace xirang::analysis::plan
