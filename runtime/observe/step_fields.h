// runtime/observe/step_fields.h: the step's times, named once.
//
// Each duration a step reports (StepMetrics' *_ms fields) is one row here:
// its metrics.jsonl key, its unit, what it holds, how it relates to
// step_ms, and its Prometheus gauge. The JSONL writer, the Prometheus
// exporter, the baseline comparison, `xirang report` and the sweeps read
// this table instead of listing the fields again; docs/metrics.md
// documents every row (a test checks that it does).
//
//   for (const StepField& f : step_fields())
//     if (f.kind == StepField::Kind::Part) named += m.*f.value;
//   // named + m.unaccounted_ms == m.step_ms on the CPU (core/step_clock.h)
#pragma once

#include <optional>
#include <span>

#include "core/step_clock.h"
#include "runtime/observe/metrics.h"

namespace xirang {

struct StepField {
  enum class Kind {
    Total,        // step_ms: the step's wall time
    Part,         // one of the disjoint parts (a StepPart of the step clock)
    Overlapped,   // a duration that runs beside the parts (dp_comm_ms), not one of them
    Unaccounted,  // what no part claimed: step_ms less the parts
  };
  const char* key;            // metrics.jsonl ("forward_ms"); the unit is its suffix
  const char* unit;           // "ms"
  const char* help;           // one line of what it holds, as Prometheus' HELP says it
  Kind kind;
  double StepMetrics::*value;
  std::optional<StepPart> part;  // Kind::Part: the clock's part it holds
  const char* gauge;          // Prometheus gauge in seconds ("xirang_step_forward_seconds"); null: none
  bool baseline;              // compared against metrics.baseline's run
};

// In metrics.jsonl's order.
std::span<const StepField> step_fields();
// The row of a part of the step clock, and of a key (null when none).
const StepField& step_field(StepPart part);
const StepField* find_step_field(const char* key);

}  // namespace xirang
