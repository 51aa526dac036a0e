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

std::string executor_problem(ScheduleKind kind) {
  if (kind == ScheduleKind::ZeroBubbleV)
    return "parallel.schedule=zb_v is simulated only: the executor places local chunk c of pipeline rank r at model "
           "chunk c x parallel.pp + r, not in a V (runtime/step/schedule.h)";
  return "";
}

}  // namespace xirang
