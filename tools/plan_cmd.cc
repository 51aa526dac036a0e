// xirang plan CONFIG --cluster CLUSTER.yaml [--set k=v ...] [--gpus N] [--global-batch B]
//             [--layout tp=T,pp=P,...] [--top K] [--explain] [--json] [--assume FEATURE,...]
// xirang plan --calibrate RESULTS.jsonl --cluster BASE.yaml -o CLUSTER.yaml [--holdout odd|even|none] [--json]
//
// The performance and memory model (analysis/plan/, docs/performance_model.md):
// predicts memory per device and step time for layouts of a config on a
// cluster, ranks every layout of N devices, or fits a cluster file's
// constants to a sweep's measured step times.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/config/config.h"
#include "tools/commands.h"
#include "analysis/plan/calibrate.h"
#include "analysis/plan/output.h"
#include "analysis/plan/search.h"

namespace xirang::tools {

namespace {

using namespace plan;

struct PlanArgs {
  std::string config, cluster, layout, calibrate, out, holdout = "odd";
  std::vector<std::string> overrides;
  int gpus = 0, global_batch = 0, top = 10;
  bool explain = false, json = false;
  Features features;
};

int int_arg(const std::string& flag, const char* v) {
  try {
    size_t used = 0;
    const int n = std::stoi(v, &used);
    if (used == std::string(v).size() && n > 0) return n;
  } catch (const std::exception&) {
  }
  fail(ErrorKind::Usage, "plan: ", flag, " needs a positive integer, got '", v, "'");
}

void parse_features(const std::string& list, Features& f) {
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string name = list.substr(at, comma - at);
    if (name == "tp_comm_overlap") f.tp_comm_overlap = true;
    else if (name == "param_gather_overlap") f.param_gather_overlap = true;
    else fail(ErrorKind::Usage, "plan: --assume: unknown feature '", name, "' (expected tp_comm_overlap, param_gather_overlap)");
    at = comma + 1;
  }
}

PlanArgs parse(int argc, char** argv) {
  PlanArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "plan: ", s, " needs a value");
      return argv[++i];
    };
    if (s == "--cluster") a.cluster = value();
    else if (s == "--set") a.overrides.push_back(value());
    else if (s == "--gpus") a.gpus = int_arg(s, value());
    else if (s == "--global-batch") a.global_batch = int_arg(s, value());
    else if (s == "--layout") a.layout = value();
    else if (s == "--top") a.top = int_arg(s, value());
    else if (s == "--explain") a.explain = true;
    else if (s == "--json") a.json = true;
    else if (s == "--assume") parse_features(value(), a.features);
    else if (s == "--calibrate") a.calibrate = value();
    else if (s == "-o" || s == "--out") a.out = value();
    else if (s == "--holdout") a.holdout = value();
    else if (!s.empty() && s[0] == '-') fail(ErrorKind::Usage, "plan: unknown option '", s, "'");
    else if (a.config.empty()) a.config = s;
    else fail(ErrorKind::Usage, "plan: more than one config ('", a.config, "' and '", s, "')");
  }
  if (a.cluster.empty()) fail(ErrorKind::Usage, "plan: --cluster CLUSTER.yaml is required");
  if (a.calibrate.empty() && a.config.empty()) fail(ErrorKind::Usage, "plan: a CONFIG is required");
  return a;
}

int run_calibration(const PlanArgs& a) {
  if (a.out.empty()) fail(ErrorKind::Usage, "plan: --calibrate needs -o CLUSTER.yaml");
  const Cluster base = load_cluster(a.cluster);
  const CalibrationResult r = calibrate(read_sweep(a.calibrate), base, parse_holdout(a.holdout));
  if (a.json) {
    nlohmann::json j;
    auto rows = [](const std::vector<PointError>& v) {
      nlohmann::json a = nlohmann::json::array();
      for (const PointError& e : v) a.push_back({{"id", e.id}, {"measured_s", e.measured_s}, {"predicted_s", e.predicted_s}});
      return a;
    };
    j["fitted"] = rows(r.fitted);
    j["held_out"] = rows(r.held_out);
    j["held_out_median_error"] = r.held_out_median_error;
    j["held_out_max_error"] = r.held_out_max_error;
    j["contended_points"] = r.contended_points;
    j["backward_factor"] = r.cluster.backward_factor;
    j["backward_points"] = r.backward_points;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::fputs(calibration_report(r).c_str(), stdout);
  }
  std::ofstream out(a.out);
  if (!out) fail(ErrorKind::Config, "plan: cannot write '", a.out, "'");
  out << cluster_yaml(r.cluster, str_cat("# Fitted by `xirang plan --calibrate ", a.calibrate, "` on ",
                                         r.fit_points, " points (docs/performance_model.md).\n"));
  return 0;
}

int run_plan(const PlanArgs& a) {
  const Cluster cluster = load_cluster(a.cluster);
  Config cfg = load_config(a.config, a.overrides);
  if (a.global_batch > 0) cfg.train.global_batch = a.global_batch;
  const Workload w = workload_of(cfg);
  std::vector<Prediction> shown;
  if (!a.layout.empty()) {
    const ParallelConfig& pc = cfg.parallel;
    PlanLayout base{std::max(pc.dp, 1), pc.tp, pc.pp, pc.virtual_stages, cfg.train.micro_batch, pc.zero,
                    pc.sequence_parallel, cfg.train.recompute, pc.cp};
    const PlanLayout l = parse_layout(a.layout, base);
    if (a.gpus > 0 && l.devices() != a.gpus)
      fail(ErrorKind::Config, "--layout ", l.str(), " uses ", l.devices(), " devices, not --gpus ", a.gpus);
    const std::string problem = layout_problem(w, l, cluster);
    if (!problem.empty()) fail(ErrorKind::Config, "--layout ", a.layout, ": ", problem);
    shown.push_back(predict(w, l, cluster, a.features));
  } else {
    if (a.gpus <= 0) fail(ErrorKind::Usage, "plan: --gpus N is required to search (or give --layout)");
    SearchOptions o;
    o.devices = a.gpus;
    o.top = a.top;
    o.features = a.features;
    const SearchResult r = search(w, cluster, o);
    if (r.ranked.empty())
      fail(ErrorKind::Memory, "no layout of ", a.gpus, " devices fits: ", r.candidates, " layouts allowed, ",
           r.rejected_memory, " over the ", cluster.usable_memory_bytes() / 1e9, " GB usable per device");
    shown = r.ranked;
    if (!a.json)
      std::printf("%d layouts of %d devices allowed; %zu fastest that fit memory (%d faster ones do not):\n",
                  r.candidates, a.gpus, shown.size(), r.rejected_memory);
  }
  if (a.json) {
    nlohmann::json j;
    j["cluster"] = cluster.name;
    j["devices"] = shown.front().layout.devices();
    for (const Prediction& p : shown) j["layouts"].push_back(to_json(p));
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::fputs(table(shown, cluster).c_str(), stdout);
  if (a.explain)
    for (const Prediction& p : shown) std::printf("\n%s", explain(p, w, cluster).c_str());
  if (shown.size() == 1 && !shown.front().fits)
    std::printf("warning: this layout does not fit in %.1f GB per device\n", cluster.usable_memory_bytes() / 1e9);
  return 0;
}

}  // namespace

int plan_command(int argc, char** argv) {
  const PlanArgs a = parse(argc, argv);
  return a.calibrate.empty() ? run_plan(a) : run_calibration(a);
}

}  // namespace xirang::tools
