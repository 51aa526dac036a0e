// A point's runs read back (the log for the outcome and the memory plan,
// metrics.jsonl for the steps) and summarised into its results row.
#include <algorithm>
#include <fstream>
#include <regex>

#include "core/error.h"
#include "runtime/observe/step_fields.h"
#include "analysis/sweep/sweep.h"

namespace xirang::analysis::sweep {

// Every time of the step but step_ms itself (runtime/observe/step_fields.h).
const std::vector<std::string>& breakdown_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const StepField& f : step_fields())
      if (f.kind != StepField::Kind::Total) k.push_back(f.key);
    return k;
  }();
  return keys;
}

namespace {

double field(const Json& j, const std::string& key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

// step_ms less the disjoint parts (dp_comm_ms overlaps backward and is not one).
double unaccounted(const Json& j) {
  double named = 0;
  for (const StepField& f : step_fields())
    if (f.kind == StepField::Kind::Part) named += field(j, f.key);
  return field(j, "step_ms") - named;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t lo = size_t(pos), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - double(lo)) * (v[hi] - v[lo]);
}

// "  total        1.25 MiB" of the memory plan rank 0 prints at start.
std::optional<double> plan_total(const std::string& line) {
  static const std::regex re(R"(^  total +([0-9.]+) (B|KiB|MiB|GiB|TiB)\s*$)");
  std::smatch m;
  if (!std::regex_match(line, m, re)) return std::nullopt;
  const std::string units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = std::stod(m[1]);
  for (const std::string& u : units) {
    if (m[2] == u) return v;
    v *= 1024;
  }
  return std::nullopt;
}

// The error the run ended with, without the "xirang: [rank N: ]" prefix:
// rank 0's line when it wrote one (its memory plan is the one recorded), else the first.
std::string error_line(const std::vector<std::string>& lines, const std::string& kind) {
  for (const char* who : {"xirang: rank 0: ", "xirang: "})
    for (const std::string& l : lines) {
      const size_t at = l.find(who);
      if (at == std::string::npos || l.find(kind, at) == std::string::npos) continue;
      std::string msg = l.substr(at + 8);
      if (msg.rfind("rank ", 0) == 0 && msg.find(": ") != std::string::npos) msg = msg.substr(msg.find(": ") + 2);
      return msg;
    }
  return {};
}

std::vector<Json> read_steps(const std::string& path, int warmup) {
  std::vector<Json> steps;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step_ms")) continue;
    if (field(j, "step") > warmup) steps.push_back(std::move(j));
  }
  return steps;
}

}  // namespace

RunOutcome read_run(const LaunchResult& r, const std::string& log_path, const std::string& metrics_path, int warmup) {
  RunOutcome out;
  out.wall_s = r.wall_s;
  out.cpu_s = r.cpu_s;
  std::vector<std::string> lines;
  std::ifstream log(log_path);
  for (std::string l; std::getline(log, l);) {
    if (auto b = plan_total(l); b && !out.memory_bytes) out.memory_bytes = b;
    lines.push_back(l);
  }
  if (r.timed_out) {
    out.status = "timeout";
    out.reason = str_cat("no result within timeout_s=", r.limit_s, "; the process group was killed");
  } else if (std::string m = error_line(lines, "memory error: "); !m.empty()) {
    out.status = "oom";
    out.reason = m;
  } else if (r.exit_code != 0) {
    out.status = "failed";
    out.reason = error_line(lines, ": ");
    if (out.reason.empty()) {
      std::string last;
      for (const std::string& l : lines)
        if (l.find_first_not_of(" \t") != std::string::npos) last = l;
      out.reason = str_cat("exit status ", r.exit_code, last.empty() ? "" : ": " + last);
    }
  } else {
    out.steps = read_steps(metrics_path, warmup);
    // The exact plan total, where the metrics carry it (the printed plan is rounded).
    if (!out.steps.empty() && out.steps.front().contains("memory_planned_bytes"))
      out.memory_bytes = field(out.steps.front(), "memory_planned_bytes");
    out.status = out.steps.empty() ? "failed" : "ok";
    if (out.steps.empty()) out.reason = str_cat("no measured step in ", metrics_path);
  }
  return out;
}

namespace {

Json layout_of(const Config& c) {
  return {{"dp", c.parallel.dp},
          {"cp", c.parallel.cp},
          {"tp", c.parallel.tp},
          {"pp", c.parallel.pp},
          {"virtual_stages", c.parallel.virtual_stages},
          {"schedule", schedule_name(c.parallel.schedule)},
          {"zero", c.parallel.zero},
          {"sequence_parallel", c.parallel.sequence_parallel},
          {"micro_batch", c.train.micro_batch},
          {"global_batch", c.train.global_batch},
          {"recompute", config_name(c.train.recompute)}};
}

Json model_of(const Config& c) {
  return {{"n_layer", c.model.n_layer},
          {"d_model", c.model.d_model},
          {"n_head", c.model.n_head},
          {"seq_len", c.seq_len()},
          {"vocab_size", c.model.vocab_size}};
}

// Medians and spread over the pooled measured steps of every repeat.
void add_statistics(Json& row, const std::vector<RunOutcome>& runs) {
  std::vector<Json> steps;
  for (const RunOutcome& r : runs) steps.insert(steps.end(), r.steps.begin(), r.steps.end());
  auto column = [&](auto get) {
    std::vector<double> v;
    for (const Json& s : steps) v.push_back(get(s));
    return v;
  };
  const std::vector<double> step_ms = column([](const Json& s) { return field(s, "step_ms"); });
  const double median = percentile(step_ms, 0.5);
  row["steps_measured"] = steps.size();
  row["step_ms_median"] = median;
  row["step_ms_p10"] = percentile(step_ms, 0.1);
  row["step_ms_p90"] = percentile(step_ms, 0.9);
  row["tokens_per_s"] = percentile(column([](const Json& s) { return field(s, "tokens_per_s"); }), 0.5);
  row["mfu"] = percentile(column([](const Json& s) { return field(s, "mfu"); }), 0.5);
  Json breakdown = Json::object(), shares = Json::object();
  for (const std::string& k : breakdown_keys()) {
    const bool rest = find_step_field(k.c_str())->kind == StepField::Kind::Unaccounted;
    const double v = percentile(column([&](const Json& s) { return rest ? unaccounted(s) : field(s, k); }), 0.5);
    breakdown[k] = v;
    shares[k.substr(0, k.size() - 3)] = median > 0 ? v / median : 0.0;
  }
  row["breakdown_ms"] = breakdown;
  row["shares"] = shares;
}

// How much of the machine a point's runs had (see make_row in sweep.h).
Json host_of(const std::vector<RunOutcome>& runs, int ranks) {
  double wall = 0, cpu = 0;
  bool have_cpu = !runs.empty();
  std::vector<double> wait_share;
  for (const RunOutcome& r : runs) {
    wall += r.wall_s;
    cpu += r.cpu_s;
    have_cpu = have_cpu && r.cpu_s >= 0;
    for (const Json& s : r.steps)
      if (s.contains("cpu_wait_ms") && s["cpu_wait_ms"].is_number() && field(s, "step_ms") > 0)
        wait_share.push_back(s["cpu_wait_ms"].get<double>() / field(s, "step_ms"));
  }
  Json h = Json::object();
  h["wall_s"] = wall;
  h["cpu_busy"] = have_cpu && wall > 0 ? Json(cpu / (wall * std::max(ranks, 1))) : Json(nullptr);
  h["cpu_wait_share"] = wait_share.empty() ? Json(nullptr) : Json(percentile(wait_share, 0.5));
  return h;
}

}  // namespace

double run_median_ms(const RunOutcome& r) {
  std::vector<double> v;
  for (const Json& s : r.steps) v.push_back(field(s, "step_ms"));
  return percentile(v, 0.5);
}

Json make_row(const Point& p, const Prepared& pre, const std::vector<RunOutcome>& runs) {
  Json row = {{"point", p.index}, {"id", p.id}, {"settings", Json::object()}};
  for (const Setting& s : p.settings)
    if (s.key != "ranks") row["settings"][s.key] = s.value;  // config keys only: ranks has its own field
  row["ranks"] = pre.ranks;
  std::string status = pre.refused.empty() ? "ok" : "refused", reason = pre.refused;
  std::optional<double> memory;
  for (const RunOutcome& r : runs) {
    if (r.memory_bytes && !memory) memory = r.memory_bytes;
    if (status == "ok" && r.status != "ok") {
      status = r.status;
      reason = r.reason;
    }
  }
  row["status"] = status;
  row["reason"] = reason;
  row["layout"] = layout_of(*pre.config);
  row["model"] = model_of(*pre.config);
  row["precision"] = config_name(pre.config->precision.dtype);
  row["repeats"] = status == "refused" ? 0 : int(runs.size());
  if (status == "ok") add_statistics(row, runs);
  else
    for (const char* k : {"steps_measured", "step_ms_median", "step_ms_p10", "step_ms_p90", "tokens_per_s", "mfu",
                          "breakdown_ms", "shares"})
      row[k] = nullptr;
  row["memory_bytes_per_rank"] = memory ? Json(int64_t(*memory)) : Json(nullptr);
  row["host"] = host_of(runs, pre.ranks);
  return row;
}

}  // namespace xirang::analysis::sweep
