// runtime/observe/straggler.h: finds the rank that holds the others back.
//
// Every metrics.straggler_every steps all ranks exchange, in one all_gather
// of two doubles on the world communicator, their compute time (forward +
// backward, the median over the steps since the last check, so that one
// step preempted on a loaded machine does not count) and their step time.
// Each rank then knows the slowest rank, its ratio to the median of the
// other ranks (with two ranks: the other one) and its milliseconds over
// that median, and writes them into the step's metrics (slowest_rank,
// straggler_ratio, straggler_extra_ms; kept between checks).
// Compute time, not step time: a step ends together on every rank (the
// reductions wait for the slowest), while compute is each rank's own.
// When one rank stays above metrics.straggler_ratio for
// metrics.straggler_checks checks in a row, world rank 0 prints one line:
//
//   straggler: rank 3 (dp 3, tp 0, pp 0) compute 251.2 ms is 4.10 x the median for 3 checks (step 18; its step time 266.9 ms)
//
//   observers.push_back(std::make_unique<StragglerDetector>(cfg.metrics, grid));
#pragma once

#include <vector>

#include "comm/process_grid.h"
#include "runtime/config/config.h"
#include "runtime/observe/step_observer.h"

namespace xirang {

// The slowest of the ranks' times, and its ratio to the median of the others.
struct StragglerFinding {
  int rank = -1;
  double ms = 0;     // its time
  double ratio = 0;  // ms over the others' median (0 when that is 0, or with one rank: 1)
  double extra_ms = 0;  // ms less the others' median (0 with one rank): what the others wait for it
};
StragglerFinding find_straggler(const std::vector<double>& ms_per_rank);

class StragglerDetector : public StepObserver {
 public:
  // `grid` must outlive the detector; only world rank 0 prints.
  StragglerDetector(const MetricsConfig& metrics, ProcessGrid& grid);
  void on_step(StepMetrics& m) override;

 private:
  void check(int step);

  int every_, checks_;
  double ratio_;
  ProcessGrid& grid_;
  std::vector<double> compute_ms_, step_ms_;  // this rank's steps since the last check
  StragglerFinding last_;                     // the last check's
  int run_rank_ = -1;                         // the rank above the ratio at the last checks
  int run_ = 0;                               // how many checks in a row
};

}  // namespace xirang
