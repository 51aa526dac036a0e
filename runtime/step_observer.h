// runtime/step_observer.h: what watches the training steps as they end.
//
// The trainer calls each observer once per step on every rank, in the order
// they were added, after the step's metrics are complete and before they are
// recorded and logged: an observer may fill fields of the step's metrics
// (the straggler detector its findings) and may take part in collectives
// (every rank calls it at the same point of every step). The exporters and
// monitors of the metrics live in observers, each in a file of its own, so
// the step loop stays as it is.
//
//   class Printer : public StepObserver {
//     void on_step(StepMetrics& m) override { std::printf("%d %g\n", m.step, m.loss); }
//   };
//   trainer_observers.push_back(std::make_unique<Printer>());
#pragma once

#include "runtime/metrics.h"

namespace xirang {

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual void on_step(StepMetrics& m) = 0;
  // After the last step of the run (also after a run that had no steps left).
  virtual void on_finish() {}
};

}  // namespace xirang
