#include "runtime/config/schedule_rules.h"

#include "core/error.h"

namespace xirang {

std::string schedule_problem(ScheduleKind kind, int pp, int virtual_stages, int microbatches,
                             std::string_view microbatches_from) {
  const bool interleaved = kind == ScheduleKind::Interleaved;
  // The V is two chunks per rank by construction.
  if (kind == ScheduleKind::ZeroBubbleV && virtual_stages != 2)
    return str_cat("parallel.schedule=zb_v needs parallel.virtual_stages=2 (its two chunks per rank make the V; got ",
                   virtual_stages, ")");
  if (!interleaved && kind != ScheduleKind::ZeroBubbleV && virtual_stages != 1)
    return str_cat("parallel.virtual_stages=", virtual_stages, " needs parallel.schedule=interleaved (got ",
                   config_name(kind), ")");
  if (interleaved && virtual_stages < 2)
    return str_cat("parallel.schedule=interleaved needs parallel.virtual_stages >= 2 (got ", virtual_stages, ")");
  // One stage runs B and W back to back: the split only costs its extra passes.
  if ((kind == ScheduleKind::ZeroBubbleH1 || kind == ScheduleKind::ZeroBubbleH2 || kind == ScheduleKind::ZeroBubbleV) &&
      pp < 2)
    return str_cat("parallel.schedule=", config_name(kind),
                   " needs parallel.pp >= 2 (one stage has no bubble for the split backward to fill)");
  // Groups of pp microbatches go through each chunk in turn.
  if (interleaved && pp > 0 && microbatches % pp != 0)
    return str_cat("parallel.schedule=interleaved needs the microbatches per step (",
                   microbatches_from.empty() ? std::to_string(microbatches) : std::string(microbatches_from),
                   ") to be a multiple of parallel.pp (", pp, ")");
  return "";
}

std::string executor_problem(ScheduleKind kind, bool ordered_p2p, Backend backend, int cp) {
  if (kind != ScheduleKind::ZeroBubbleV) return "";
  if (ordered_p2p)
    return "parallel.schedule=zb_v needs comm.ordered_p2p=false (its V sends activations both ways between "
           "neighbours; the order-matched queues are paired for one direction)";
  if (backend == Backend::CUDA)
    return "parallel.schedule=zb_v runs on device.backend=cpu only (NCCL pairs transfers by order, and the V's "
           "two-way activations have not been paired on a device)";
  if (cp > 1)
    return str_cat("parallel.schedule=zb_v with parallel.cp=", cp, " is untested: use parallel.cp=1");
  return "";
}

}  // namespace xirang
