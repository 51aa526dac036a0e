// The device's energy over a run's steps (joules_per_token, avg_watts in
// metrics.jsonl), or why the run has none.
#include <algorithm>
#include <vector>

#include "analysis/report/report.h"

namespace xirang::analysis::report {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Why a run without energy fields has none, from the backend its lines (or its config) name.
std::string why_not_measured(const Run& run) {
  std::string backend = run.steps.front().backend;
  if (backend.empty() && run.config) backend = run.config->device.backend == Backend::CUDA ? "cuda" : "cpu";
  if (backend == "cpu") return "CPU backend: no energy counter on this machine";
  if (backend == "cuda")
    return "CUDA backend, but NVML gave no readings: the run's warning at start names the reason";
  return "the metrics have no joules_per_token (written before energy was measured)";
}

}  // namespace

EnergySummary energy_summary(const Run& run) {
  EnergySummary e;
  std::vector<const StepRow*> rows;
  for (const StepRow& r : run.steps)
    if (r.joules_per_token && r.avg_watts) rows.push_back(&r);
  // Step 1 pays one-time costs (allocation, compilation of kernels), as in summarise().
  if (rows.size() > 1 && rows.front()->step == 1) rows.erase(rows.begin());
  e.steps = int(rows.size());
  if (rows.empty()) {
    e.not_measured = why_not_measured(run);
    return e;
  }
  std::vector<double> jpt, watts;
  for (const StepRow* r : rows) {
    jpt.push_back(*r->joules_per_token);
    watts.push_back(*r->avg_watts);
  }
  e.joules_per_token = median(jpt);
  e.avg_watts = median(watts);
  e.source = rows.back()->energy_source;
  return e;
}

}  // namespace xirang::analysis::report
