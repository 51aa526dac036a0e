#include "runtime/observe/baseline.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/observe/step_fields.h"

namespace xirang {

namespace {

// The compared fields: the metrics.jsonl key and the step metric it holds.
struct Field {
  const char* key;
  double StepMetrics::*value;
};
// tokens/s first (the monitored one), then the step's times the table marks (runtime/observe/step_fields.h).
const std::vector<Field>& compared_fields() {
  static const std::vector<Field> fields = [] {
    std::vector<Field> v = {{"tokens_per_s", &StepMetrics::tokens_per_s}};
    for (const StepField& f : step_fields())
      if (f.baseline) v.push_back({f.key, f.value});
    return v;
  }();
  return fields;
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  const size_t h = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + h, v.end());
  if (v.size() % 2) return v[h];
  return 0.5 * (v[h] + *std::max_element(v.begin(), v.begin() + h));
}

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  return std::filesystem::weakly_canonical(a, ec) == std::filesystem::weakly_canonical(b, ec);
}

// The medians of compared_fields() over the file's steps after the first (NaN: a field no step has).
std::vector<double> read_medians(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(ErrorKind::Config, "metrics.baseline: cannot open '", path, "': ", std::strerror(errno));
  std::vector<std::vector<double>> values(compared_fields().size());
  std::string line;
  int n = 0, steps = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("tokens_per_s") || !j["tokens_per_s"].is_number())
      fail(ErrorKind::Data, "metrics.baseline '", path, "' line ", n,
           ": not a metrics.jsonl step (a JSON object with tokens_per_s)");
    if (steps++ == 0) continue;  // the first step pays the warm-up
    for (size_t f = 0; f < compared_fields().size(); ++f) {
      const char* key = compared_fields()[f].key;
      if (j.contains(key) && j[key].is_number()) values[f].push_back(j[key].get<double>());
    }
  }
  if (steps < 2)
    fail(ErrorKind::Data, "metrics.baseline '", path, "' has ", steps,
         " step(s); its median is over the steps after the first, so it needs at least 2");
  std::vector<double> medians;
  for (auto& v : values) medians.push_back(median(v));
  return medians;
}

}  // namespace

BaselineMonitor::BaselineMonitor(const MetricsConfig& metrics, bool print)
    : path_(metrics.baseline), tolerance_(metrics.baseline_tolerance), steps_(metrics.baseline_steps), print_(print) {
  if (!metrics.jsonl.empty() && same_file(metrics.jsonl, path_))
    fail(ErrorKind::Config, "metrics.baseline='", path_, "' is also metrics.jsonl: the run would overwrite its baseline");
  base_ = read_medians(path_);
  floor_ = base_[0] * (1 - tolerance_);
  seen_.resize(compared_fields().size());
}

void BaselineMonitor::on_step(StepMetrics& m) {
  if (first_) {  // this run's warm-up, left out like the baseline's
    first_ = false;
    return;
  }
  for (size_t f = 0; f < compared_fields().size(); ++f) seen_[f].push_back(m.*compared_fields()[f].value);
  // A run of steps on the other side of the band than the state says.
  const bool low = m.tokens_per_s < floor_;
  if (low != below_) {
    if (run_++ == 0) run_start_ = m.step;
  } else {
    run_ = 0;
  }
  if (run_ >= steps_) {
    below_ = low;
    run_ = 0;
    if (print_) {
      if (below_)
        std::fprintf(stderr,
                     "baseline: tokens/s %.0f is %.0f%% below the baseline's %.0f for %d steps (since step %d; "
                     "metrics.baseline %s)\n",
                     m.tokens_per_s, 100 * (1 - m.tokens_per_s / base_[0]), base_[0], steps_, run_start_, path_.c_str());
      else
        std::fprintf(stderr, "baseline: tokens/s %.0f back within %.0f%% of the baseline's %.0f for %d steps (step %d)\n",
                     m.tokens_per_s, 100 * tolerance_, base_[0], steps_, m.step);
      std::fflush(stderr);
    }
  }
  m.below_baseline = below_;
}

void BaselineMonitor::on_finish() {
  if (!print_ || seen_[0].empty()) return;
  std::fprintf(stderr, "baseline comparison (medians over the steps after the first; this run vs %s):\n", path_.c_str());
  for (size_t f = 0; f < compared_fields().size(); ++f) {
    const double mine = median(seen_[f]), base = base_[f];
    // Components that are zero in both runs (no pipeline, no checkpoint) say nothing.
    if (std::isnan(base) || (std::abs(mine) < 0.05 && std::abs(base) < 0.05)) continue;
    char change[32] = "";
    if (base > 0) std::snprintf(change, sizeof change, "%+.1f%%", 100 * (mine / base - 1));
    std::fprintf(stderr, "  %-20s %12.1f %12.1f  %s\n", compared_fields()[f].key, mine, base, change);
  }
  std::fflush(stderr);
}

}  // namespace xirang
