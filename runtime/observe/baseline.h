// runtime/observe/baseline.h: this run's throughput against an earlier run's.
//
// metrics.baseline is the metrics.jsonl of an earlier run (of the same
// config, normally). Its reference is the median over its steps after the
// first (the first pays the warm-up) of tokens_per_s, and of the step-time
// components for the closing comparison. The file is read when the monitor
// is built, before training: a missing or unreadable file is one error line
// (ErrorKind::Config; a file without usable steps: ErrorKind::Data).
//
// While training (this run's first step is skipped as well), a step is low
// when its tokens/s is more than metrics.baseline_tolerance below the
// reference. After metrics.baseline_steps low steps in a row the run is
// below the baseline (StepMetrics::below_baseline) until as many steps in a
// row are back in the band, so that one noisy step neither starts nor ends
// it. World rank 0 prints one line when it starts and one when it ends:
//
//   baseline: tokens/s 2210 is 62% below the baseline's 5830 for 5 steps (since step 3; metrics.baseline runs/a.jsonl)
//   baseline: tokens/s 5790 back within 10% of the baseline's 5830 for 5 steps (step 20)
//
// and at the end a short table: the medians of tokens/s and of the step
// time and its components, this run against the baseline.
//
//   observers.push_back(std::make_unique<BaselineMonitor>(cfg.metrics, world_rank == 0));
#pragma once

#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/observe/step_observer.h"

namespace xirang {

class BaselineMonitor : public StepObserver {
 public:
  // Reads metrics.baseline now (see above for its errors); `print`: this rank prints the lines.
  BaselineMonitor(const MetricsConfig& metrics, bool print);
  void on_step(StepMetrics& m) override;
  void on_finish() override;

 private:
  std::string path_;
  double tolerance_;
  int steps_;
  bool print_;
  std::vector<double> base_;               // the baseline's medians, per compared field (baseline.cc)
  double floor_;                           // tokens/s below this is low
  std::vector<std::vector<double>> seen_;  // this run's values of those fields, steps after its first
  bool first_ = true;
  bool below_ = false;
  int run_ = 0;         // steps in a row on the other side of the band than below_ says
  int run_start_ = 0;   // the first step of that run
};

}  // namespace xirang
