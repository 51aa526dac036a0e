#include "runtime/observe/step_fields.h"

#include <cstring>

#include "core/error.h"

namespace xirang {

namespace {

using K = StepField::Kind;

// The order is metrics.jsonl's; docs/metrics.md's table says more of each.
constexpr StepField kFields[] = {
    {"step_ms", "ms", "Wall time of the last step.", K::Total, &StepMetrics::step_ms, std::nullopt,
     "xirang_step_seconds", true},
    {"forward_ms", "ms", "Forward passes of the last step, less their tensor-parallel communication.", K::Part,
     &StepMetrics::forward_ms, StepPart::Forward, "xirang_step_forward_seconds", true},
    {"backward_ms", "ms", "Backward passes of the last step, less their communication.", K::Part,
     &StepMetrics::backward_ms, StepPart::Backward, "xirang_step_backward_seconds", true},
    {"optimizer_ms", "ms",
     "Gradient norm, clipping and optimizer update of the last step, less their data-parallel waits.", K::Part,
     &StepMetrics::optimizer_ms, StepPart::Optimizer, "xirang_step_optimizer_seconds", true},
    {"data_wait_ms", "ms",
     "Time the last step spent getting input: blocked on the loader and copying microbatches in.", K::Part,
     &StepMetrics::data_wait_ms, StepPart::DataWait, "xirang_step_data_wait_seconds", true},
    {"dp_comm_ms", "ms", "Data-parallel communication time of the last step (overlapped or not).", K::Overlapped,
     &StepMetrics::dp_comm_ms, std::nullopt, "xirang_step_dp_comm_seconds", false},
    {"dp_comm_exposed_ms", "ms",
     "Time the last step spent on data-parallel communication: bucket launches and waits.", K::Part,
     &StepMetrics::dp_comm_exposed_ms, StepPart::DpCommExposed, "xirang_step_dp_comm_exposed_seconds", true},
    {"tp_comm_ms", "ms", "Tensor-parallel communication time of the last step (blocking).", K::Part,
     &StepMetrics::tp_comm_ms, StepPart::TpComm, "xirang_step_tp_comm_seconds", true},
    {"cp_comm_ms", "ms",
     "Context-parallel communication time of the last step: the key/value all-gathers and their gradients' "
     "reduce-scatters (blocking).",
     K::Part, &StepMetrics::cp_comm_ms, StepPart::CpComm, "xirang_step_cp_comm_seconds", true},
    {"pp_bubble_ms", "ms", "Time the last step waited for a pipeline neighbour.", K::Part, &StepMetrics::pp_bubble_ms,
     StepPart::PpBubble, "xirang_step_pp_bubble_seconds", true},
    {"pp_comm_exposed_ms", "ms",
     "Time the last step waited for its own pipeline sends and the tied-embedding gradient reduction.", K::Part,
     &StepMetrics::pp_comm_exposed_ms, StepPart::PpCommExposed, "xirang_step_pp_comm_exposed_seconds", true},
    {"ckpt_stall_ms", "ms", "Time the last step was stopped to save a checkpoint.", K::Part,
     &StepMetrics::ckpt_stall_ms, StepPart::CkptStall, "xirang_step_checkpoint_stall_seconds", true},
    {"unaccounted_ms", "ms", "Time of the last step that no part claimed.", K::Unaccounted,
     &StepMetrics::unaccounted_ms, std::nullopt, nullptr, false},
};

}  // namespace

std::span<const StepField> step_fields() { return kFields; }

const StepField& step_field(StepPart part) {
  for (const StepField& f : kFields)
    if (f.part == part) return f;
  fail(ErrorKind::Internal, "no step field holds the clock's part ", step_part_name(part));
}

const StepField* find_step_field(const char* key) {
  for (const StepField& f : kFields)
    if (std::strcmp(f.key, key) == 0) return &f;
  return nullptr;
}

}  // namespace xirang
