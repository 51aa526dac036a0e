// analysis/plan/calibrate.h: fitting a cluster file to measured sweep points.
//
// A sweep's results.jsonl (one JSON object per point, written by `xirang
// sweep`; rows with status "ok" are used) gives each point's model, layout,
// precision and median step time. The fit adjusts the cluster constants the
// model's terms scale with (matrix throughput and its width curve, per-op
// overhead, memory bandwidth, the intra-node link's bandwidth and latency)
// by nonlinear least squares on log(predicted / measured) step times, with
// a weak pull toward the starting file's values so that constants no point
// constrains stay where they were. With a holdout, every other point is
// left out of the fit and predicted afterwards.
//
//   CalibrationResult r = calibrate(read_sweep("results.jsonl"), load_cluster("this_machine.yaml"), Holdout::Odd);
//   r.held_out_median_error;   // relative step-time error on the points not fitted
#pragma once

#include <string>
#include <vector>

#include "analysis/plan/cost_model.h"
#include "analysis/sweep/sweep.h"

namespace xirang::analysis::plan {

struct SweepPoint {
  int index = 0;
  std::string id;
  Workload workload;
  PlanLayout layout;
  double step_s = 0;  // measured median
  // backward_ms / forward_ms of the row's medians (breakdown_ms); -1 where
  // the row lacks them or its backward holds a recomputed forward.
  double backward_ratio = -1;
  // forward_ms + backward_ms of the row in seconds (rank 0's compute, a full
  // recomputation included, without the collectives); -1 where the row lacks
  // them or recomputes selectively (a cost the model does not have).
  double compute_s = -1;
  // host.cpu_wait_share of the row: the share of its steps rank 0 spent
  // waiting for a core; -1 where the row does not say.
  double cpu_wait_share = -1;
};

// The "ok" rows of a results.jsonl; a Data error names a malformed line or a missing field.
std::vector<SweepPoint> read_sweep(const std::string& path);

enum class Holdout { None, Odd, Even };  // which points (by position among ok rows) are held out
Holdout parse_holdout(const std::string& s);

struct PointError {
  std::string id;
  double measured_s = 0, predicted_s = 0;
  double cpu_wait_share = -1;
  double error() const { return (predicted_s - measured_s) / measured_s; }
};

struct CalibrationResult {
  Cluster cluster;
  int fit_points = 0;
  std::vector<PointError> fitted, held_out;
  double fit_median_error = 0, held_out_median_error = 0, held_out_max_error = 0;  // |relative|
  int backward_points = 0;  // fitted points whose backward_ratio set the cluster's backward_factor (0: kept)
  // Points whose cpu_wait_share exceeds sweep::kContendedShare: they measured
  // the waiting for a core as well as the work.
  int contended_points = 0;
};

CalibrationResult calibrate(const std::vector<SweepPoint>& points, const Cluster& start, Holdout holdout);
std::string calibration_report(const CalibrationResult& r);
// Predicted step time of a point on a cluster.
double predict_point(const SweepPoint& p, const Cluster& c);
// The model's whole breakdown for the point.
StepTime predict_point_times(const SweepPoint& p, const Cluster& c);

}  // namespace xirang::analysis::plan
