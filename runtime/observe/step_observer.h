// runtime/observe/step_observer.h: what watches the training steps as they end.
//
// The trainer calls each observer before each step begins and once the
// step's metrics are complete, on every rank, in the order they were added:
// an observer may fill fields of the step's metrics (the straggler detector
// its findings) for the ones after it, and may take part in collectives
// (every rank calls it at the same point of every step). Everything that
// watches a step is an observer, each in a file of its own: the monitors
// (straggler.h, baseline.h), the exporters (prometheus_exporter.h, and
// step_watchers.h's metrics.jsonl writer, progress line and trace window),
// so the step loop stays as it is.
//
//   class Printer : public StepObserver {
//     void on_step(StepMetrics& m) override { std::printf("%d %g\n", m.step, m.loss); }
//   };
//   trainer_observers.push_back(std::make_unique<Printer>());
#pragma once

#include "runtime/observe/metrics.h"

namespace xirang {

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // Before step `step` (1-based) begins, outside its time: every rank at the same point.
  virtual void on_step_begin(int step) { (void)step; }
  virtual void on_step(StepMetrics& m) = 0;
  // After the last step of the run (also after a run that had no steps left).
  virtual void on_finish() {}
};

}  // namespace xirang
