// Reading a run (metrics.jsonl and its config) and summarising it.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/observe/step_fields.h"
#include "analysis/report/report.h"

namespace xirang::analysis::report {

namespace fs = std::filesystem;

const char* part_name(Part p) {
  static const char* names[kParts] = {"compute (fwd+bwd)", "optimizer", "data wait", "dp comm (exposed)",
                                      "tp comm", "cp comm", "pipeline bubble", "pp transfers (exposed)",
                                      "checkpoint stall", "unaccounted"};
  return names[int(p)];
}

const char* part_key(Part p) {
  static const char* keys[kParts] = {"compute",  "optimizer",   "data_wait",  "dp_comm_exposed", "tp_comm", "cp_comm",
                                     "pp_bubble", "pp_comm_exposed", "ckpt_stall", "unaccounted"};
  return keys[int(p)];
}

namespace {

// The report's part of the step clock's part: forward and backward are one, compute.
Part report_part(StepPart p) {
  switch (p) {
    case StepPart::Forward:
    case StepPart::Backward: return Part::Compute;
    case StepPart::Optimizer: return Part::Optimizer;
    case StepPart::DataWait: return Part::DataWait;
    case StepPart::DpCommExposed: return Part::DpExposed;
    case StepPart::TpComm: return Part::TpComm;
    case StepPart::CpComm: return Part::CpComm;
    case StepPart::PpBubble: return Part::PpBubble;
    case StepPart::PpCommExposed: return Part::PpExposed;
    case StepPart::CkptStall: return Part::CkptStall;
    case StepPart::DeviceWait: break;  // no field holds it
  }
  return Part::Unaccounted;
}

double number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

// One metrics line; fields this version does not know are ignored.
StepRow parse_row(const nlohmann::json& j) {
  StepRow r;
  r.step = int(number(j, "step"));
  r.loss = number(j, "loss");
  r.tokens_per_s = number(j, "tokens_per_s");
  r.step_ms = number(j, "step_ms");
  r.mfu = number(j, "mfu");
  r.dp_comm_ms = number(j, "dp_comm_ms");
  auto& m = r.ms;
  for (const StepField& f : step_fields())
    if (f.kind == StepField::Kind::Part) m[int(report_part(*f.part))] += number(j, f.key);
  double named = 0;
  for (int i = 0; i < kParts - 1; ++i) named += m[i];
  m[int(Part::Unaccounted)] = r.step_ms - named;
  if (auto it = j.find("val_loss"); it != j.end() && it->is_number()) r.val_loss = it->get<double>();
  if (auto it = j.find("joules_per_token"); it != j.end() && it->is_number()) r.joules_per_token = it->get<double>();
  if (auto it = j.find("avg_watts"); it != j.end() && it->is_number()) r.avg_watts = it->get<double>();
  if (auto it = j.find("energy_source"); it != j.end() && it->is_string()) r.energy_source = it->get<std::string>();
  if (auto it = j.find("backend"); it != j.end() && it->is_string()) r.backend = it->get<std::string>();
  if (auto it = j.find("slowest_rank"); it != j.end() && it->is_number_integer()) r.slowest_rank = it->get<int>();
  r.straggler_ratio = number(j, "straggler_ratio");
  if (auto it = j.find("straggler_extra_ms"); it != j.end() && it->is_number())
    r.straggler_extra_ms = it->get<double>();
  // metrics.op_profile (analysis/report/ops.cc): the kinds this version knows.
  if (auto ms = j.find("op_ms"); ms != j.end() && ms->is_object()) {
    r.has_ops = true;
    const auto calls = j.find("op_calls");
    for (int k = 0; k < kOpKindCount; ++k) {
      r.op_ms[size_t(k)] = number(*ms, op_kind_name(OpKind(k)));
      if (calls != j.end() && calls->is_object()) r.op_calls[size_t(k)] = number(*calls, op_kind_name(OpKind(k)));
    }
  }
  return r;
}

std::vector<StepRow> read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(ErrorKind::Data, "report: cannot read '", path, "'");
  std::vector<StepRow> rows;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      fail(ErrorKind::Data, "report: ", path, " line ", n, " is not a JSON object (expected metrics JSON lines)");
    if (j.contains("step") && j.contains("step_ms")) rows.push_back(parse_row(j));
  }
  if (rows.empty()) fail(ErrorKind::Data, "report: ", path, " holds no steps (no line with step and step_ms)");
  return rows;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t lo = size_t(pos), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - double(lo)) * (v[hi] - v[lo]);
}

}  // namespace

Run load_run(const std::string& path, const std::string& config_path, const std::vector<std::string>& overrides) {
  Run run;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(ErrorKind::Data, "report: '", path, "' does not exist");
  const bool dir = fs::is_directory(path, ec);
  run.metrics_path = dir ? (fs::path(path) / "metrics.jsonl").string() : path;
  if (dir && !fs::exists(run.metrics_path, ec))
    fail(ErrorKind::Data, "report: directory '", path, "' holds no metrics.jsonl");
  run.steps = read_metrics(run.metrics_path);
  run.config_path = config_path;
  if (run.config_path.empty()) {
    // A run directory may keep the config it was trained with beside its metrics.
    const fs::path beside = fs::path(run.metrics_path).parent_path() / "config.yaml";
    if (fs::exists(beside, ec)) run.config_path = beside.string();
  }
  if (!run.config_path.empty()) run.config = load_config(run.config_path, overrides);
  return run;
}

Summary summarise(const Run& run) {
  Summary s;
  s.steps = int(run.steps.size());
  // The first step pays one-time costs (allocation, first-touch, warm caches).
  s.warmup_skipped = s.steps > 1;
  const size_t first = s.warmup_skipped ? 1 : 0;
  std::vector<double> tps, mfu;
  for (size_t i = first; i < run.steps.size(); ++i) {
    const StepRow& r = run.steps[i];
    tps.push_back(r.tokens_per_s);
    mfu.push_back(r.mfu);
    s.step_ms += r.step_ms;
    s.dp_comm_ms += r.dp_comm_ms;
    for (int p = 0; p < kParts; ++p) s.ms[p] += r.ms[p];
  }
  s.used = int(tps.size());
  s.step_ms /= s.used;
  s.dp_comm_ms /= s.used;
  for (double& v : s.ms) v /= s.used;
  s.tps_median = percentile(tps, 0.5);
  s.tps_p10 = percentile(tps, 0.1);
  s.tps_p90 = percentile(tps, 0.9);
  s.mfu_median = percentile(mfu, 0.5);
  s.unaccounted_raw_ms = s.ms[int(Part::Unaccounted)];
  s.ms[int(Part::Unaccounted)] = std::max(0.0, s.unaccounted_raw_ms);
  // Shares of the shown total: the step time, or the named parts' sum when they exceed it.
  double total = 0;
  for (double v : s.ms) total += v;
  for (int p = 0; p < kParts; ++p) s.share[p] = total > 0 ? s.ms[p] / total : 0;
  return s;
}

}  // namespace xirang::analysis::report
