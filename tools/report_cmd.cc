// xirang report RUN [--baseline RUN2] [--plot DIR] [--json] [--config FILE [--set k=v ...]]
//                   [--tolerance F] [--fail-on-regression] [--trace PATH]
//
// Summarises a run's metrics.jsonl: throughput, the step's time split into
// parts, the dominant bottleneck with advice computed from the run (and its
// config, for the pipeline simulator), a comparison with a baseline run, and
// plots through gnuplot, with a timeline trace (metrics.trace) each
// rank's utilisation over the traced steps, with metrics.op_profile the
// time per kind of op, and the GPU's energy per token where it was measured. The work lives in analysis/report/; this file parses
// the arguments and prints text or one JSON object.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "tools/commands.h"
#include "analysis/report/report.h"
#include "analysis/report/trace.h"

namespace xirang::tools {

namespace {

using namespace report;

const char* kReportUsage =
    "usage: xirang report RUN [--baseline RUN2] [--plot DIR] [--json] [--config FILE [--set k=v ...]]\n"
    "                         [--tolerance F] [--fail-on-regression] [--trace PATH]\n"
    "  RUN                   a metrics.jsonl file or a directory holding one (and maybe its config.yaml)\n"
    "  --baseline RUN2       compare with another run: per-part deltas, regressions beyond the tolerance\n"
    "  --tolerance F         regression threshold as a fraction (default 0.05): tokens/s falling by more,\n"
    "                        or a part growing by more than F of the baseline's step time\n"
    "  --fail-on-regression  exit with 3 when a regression is flagged (otherwise the exit code is 0)\n"
    "  --config FILE         the run's training config (pipeline advice needs pp, schedule, microbatches);\n"
    "  --set section.key=v   overrides applied to it, as for `xirang train`\n"
    "  --trace PATH          a timeline trace (metrics.trace's directory, or the file `xirang trace merge`\n"
    "                        wrote) for the per-rank utilisation; default: RUN's directory's trace/ when present\n"
    "  --plot DIR            write step_breakdown.png, tokens_per_s.png and loss.png (and utilisation.png\n"
    "                        with a trace, ops.png with per-op times) through gnuplot\n"
    "  --json                print one JSON object instead of the text tables\n";

struct ReportArgs {
  std::string run, baseline, plot_dir, config, trace;
  std::vector<std::string> overrides;
  double tolerance = 0.05;
  bool json = false, fail_on_regression = false;
};

double parse_tolerance(const std::string& v) {
  char* end = nullptr;
  const double t = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(t >= 0 && t < 1))
    fail(ErrorKind::Usage, "report: --tolerance '", v, "' is not a fraction in [0, 1) (e.g. 0.05 for 5%)");
  return t;
}

ReportArgs parse_args(int argc, char** argv) {
  ReportArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "report: ", s, " needs a value");
      return argv[++i];
    };
    if (s == "--baseline") a.baseline = value();
    else if (s == "--plot") a.plot_dir = value();
    else if (s == "--config") a.config = value();
    else if (s == "--trace") a.trace = value();
    else if (s == "--set") a.overrides.push_back(value());
    else if (s == "--tolerance") a.tolerance = parse_tolerance(value());
    else if (s == "--json") a.json = true;
    else if (s == "--fail-on-regression") a.fail_on_regression = true;
    else if (!s.empty() && s[0] == '-')
      fail(ErrorKind::Usage, "report: unknown option '", s, "' (see xirang report --help)");
    else if (a.run.empty()) a.run = s;
    else fail(ErrorKind::Usage, "report: more than one run given ('", a.run, "' and '", s, "')");
  }
  if (a.run.empty()) fail(ErrorKind::Usage, "report: no run given (usage: xirang report RUN [options])");
  if (!a.overrides.empty() && a.config.empty()) fail(ErrorKind::Usage, "report: --set needs --config FILE");
  return a;
}

std::string pct(double v) {
  if (std::isnan(v)) return "n/a";
  char b[32];
  std::snprintf(b, sizeof b, "%+.1f%%", v);
  return b;
}

void print_summary(const Run& run, const Summary& s) {
  std::printf("run: %s (config: %s)\n", run.metrics_path.c_str(),
              run.config_path.empty() ? "none beside it; --config FILE gives one" : run.config_path.c_str());
  std::printf("steps: %d", s.steps);
  if (s.warmup_skipped) std::printf(" (step 1 skipped as warm-up; %d summarised)", s.used);
  else std::printf(" (one step only: nothing skipped as warm-up)");
  std::printf("\n\n%-12s %12s %12s %12s\n", "throughput", "median", "p10", "p90");
  std::printf("%-12s %12.1f %12.1f %12.1f\n", "tokens/s", s.tps_median, s.tps_p10, s.tps_p90);
  std::printf("%-12s %11.2f%%\n\n", "MFU", 100 * s.mfu_median);
  std::printf("step time (mean over %d steps)\n%-24s %10s %8s\n", s.used, "part", "ms", "share");
  double total = 0;
  for (int p = 0; p < kParts; ++p) {
    std::printf("%-24s %10.3f %7.1f%%\n", part_name(Part(p)), s.ms[p], 100 * s.share[p]);
    total += s.ms[p];
  }
  std::printf("%-24s %10.3f %7.1f%%\n", "total", total, 100.0);
  std::printf("%-24s %10.3f\n", "step_ms (measured)", s.step_ms);
  if (s.unaccounted_raw_ms < 0)
    std::printf("note: the named parts exceed step_ms by %.3f ms (unaccounted is negative: they overlap); "
                "unaccounted is shown as 0 and shares are of their sum\n",
                -s.unaccounted_raw_ms);
}

void print_energy(const EnergySummary& e) {
  if (e.steps == 0) {
    std::printf("\nenergy: not measured (%s)\n", e.not_measured.c_str());
    return;
  }
  std::printf("\nenergy: %.4g J/token, %.1f W (medians over %d steps; %s, rank 0's GPU)\n", e.joules_per_token,
              e.avg_watts, e.steps, e.source.empty() ? "source not named" : e.source.c_str());
}

nlohmann::ordered_json energy_json(const EnergySummary& e) {
  if (e.steps == 0) return {{"measured", false}, {"reason", e.not_measured}};
  return {{"measured", true},
          {"steps", e.steps},
          {"joules_per_token_median", e.joules_per_token},
          {"avg_watts_median", e.avg_watts},
          {"source", e.source}};
}

void print_advice(const Summary& s, const Advice& a) {
  if (a.straggler) {
    const Straggler& st = *a.straggler;
    std::printf("\nbottleneck: straggler rank %d (+%.2f ms %s a step over the other ranks' median", st.rank, st.extra_ms,
                st.cause == Part::DataWait ? "data wait" : "compute");
    if (st.rank != 0)
      std::printf("; rank 0's wait for it shows as %s, %.1f%% of the step", part_name(st.waits_in),
                  100 * s.share[int(st.waits_in)]);
    std::printf(")\n");
  } else if (a.significant)
    std::printf("\nbottleneck: %s (%.1f%% of the step)\n", part_name(a.bottleneck), 100 * s.share[int(a.bottleneck)]);
  else
    std::printf("\nbottleneck: none (compute-bound)\n");
  for (const std::string& l : a.lines) std::printf("  - %s\n", l.c_str());
}

void print_comparison(const std::string& base_path, const Comparison& c) {
  std::printf("\nbaseline: %s (regression: beyond %.1f%%)\n", base_path.c_str(), 100 * c.tolerance);
  std::printf("%-24s %10s %10s %10s %9s\n", "part", "base ms", "run ms", "delta ms", "delta");
  for (const PartDelta& d : c.parts)
    std::printf("%-24s %10.3f %10.3f %+10.3f %9s%s\n", part_name(d.part), d.base_ms, d.run_ms, d.delta_ms,
                pct(d.delta_pct).c_str(), d.regression ? "  REGRESSION" : "");
  std::printf("%-24s %10.3f %10.3f %+10.3f %9s\n", "step_ms", c.base_step_ms, c.run_step_ms,
              c.run_step_ms - c.base_step_ms, pct(c.step_delta_pct).c_str());
  std::printf("%-24s %10.1f %10.1f %+10.1f %9s%s\n", "tokens/s (median)", c.base_tps, c.run_tps, c.run_tps - c.base_tps,
              pct(c.tps_delta_pct).c_str(), c.tps_regression ? "  REGRESSION" : "");
  std::string flagged;
  for (const PartDelta& d : c.parts)
    if (d.regression) flagged += std::string(flagged.empty() ? "" : ", ") + part_name(d.part);
  if (c.tps_regression) flagged += std::string(flagged.empty() ? "" : ", ") + "tokens/s";
  std::printf("regressions: %s\n", flagged.empty() ? "none" : flagged.c_str());
}

// ---------------------------------------------------------------- per-op profile

const char* kOpCommNote =
    "in-flight time, from submission to completion: it overlaps compute and other transfers, so it is not a "
    "part of the step and the shares need not add up";

void print_op_rows(const std::vector<OpRow>& rows) {
  for (const OpRow& r : rows)
    std::printf("%-24s %10.3f %7.1f%% %10.*f\n", op_kind_name(r.kind), r.ms, 100 * r.share,
                r.calls == std::floor(r.calls) ? 0 : 1, r.calls);
}

void print_ops(const OpProfile& p) {
  std::printf("\nper-op time (metrics.op_profile; median per step over %d steps, share of the median step %.3f ms)\n",
              p.steps, p.step_ms);
  std::printf("%-24s %10s %8s %10s\n", "compute op", "ms", "share", "calls");
  print_op_rows(p.compute);
  std::printf("%-24s %10.3f %7.1f%%\n", "compute total", p.compute_ms, 100 * p.compute_share);
  if (p.comm.empty()) return;
  std::printf("%-24s %10s %8s %10s\n", "communication", "ms", "share", "calls");
  print_op_rows(p.comm);
  std::printf("note: communication is %s\n", kOpCommNote);
}

nlohmann::ordered_json ops_json(const OpProfile& p) {
  auto rows = [](const std::vector<OpRow>& v) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (const OpRow& r : v) j[op_kind_name(r.kind)] = {{"ms", r.ms}, {"share", r.share}, {"calls", r.calls}};
    return j;
  };
  return {{"steps", p.steps},
          {"step_ms", p.step_ms},
          {"compute", rows(p.compute)},
          {"compute_total", {{"ms", p.compute_ms}, {"share", p.compute_share}}},
          {"communication", rows(p.comm)},
          {"communication_note", kOpCommNote}};
}

// ----------------------------------------------------------------

void print_plots(const PlotResult& p) {
  if (!p.skipped.empty()) std::printf("\nplots skipped: %s\n", p.skipped.c_str());
  else for (const std::string& f : p.files) std::printf("%s%s\n", &f == &p.files[0] ? "\nplots: " : "       ", f.c_str());
}

void print_utilisation(const Utilisation& u) {
  std::printf("\nutilisation over traced steps %d-%d (trace: %s), share of each rank's step time\n", u.first_step,
              u.last_step, u.source.c_str());
  static const char* heads[kParts] = {"compute", "optim", "data", "dp wait", "tp comm", "bubble", "pp send", "ckpt", "other"};
  const bool with_cp = has_cp(u);
  std::printf("%-20s %9s", rank_axis(with_cp).c_str(), "step ms");
  for (const char* h : heads) std::printf(" %8s", h);
  std::printf("\n");
  for (const RankUtilisation& r : u.ranks) {
    std::printf("%-20s %9.3f", rank_label(r, with_cp).c_str(), r.step_ms);
    for (double s : r.share) std::printf(" %7.1f%%", 100 * s);
    std::printf("\n");
  }
}

nlohmann::ordered_json utilisation_json(const Utilisation& u) {
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (const RankUtilisation& r : u.ranks) {
    nlohmann::ordered_json j = {{"rank", r.rank}, {"dp", r.dp}, {"tp", r.tp}, {"pp", r.pp},
                                {"steps", r.steps}, {"step_ms", r.step_ms}};
    for (int p = 0; p < kParts; ++p) j["parts"][part_key(Part(p))] = {{"ms", r.ms[size_t(p)]}, {"share", r.share[size_t(p)]}};
    ranks.push_back(std::move(j));
  }
  return {{"trace", u.source}, {"first_step", u.first_step}, {"last_step", u.last_step}, {"ranks", std::move(ranks)}};
}

// The straggler the bottleneck names, or null.
nlohmann::ordered_json straggler_json(const std::optional<Straggler>& st) {
  if (!st) return nullptr;
  using J = nlohmann::ordered_json;
  return {{"rank", st->rank},
          {"cause", part_key(st->cause)},
          {"extra_ms", st->extra_ms},
          {"ratio", st->ratio > 0 ? J(st->ratio) : J()},
          {"extra_ms_estimated", st->estimated},
          {"evidence", st->evidence},
          {"rank0_waits_in", st->rank != 0 ? J(part_key(st->waits_in)) : J()},
          {"rank0_wait_ms", st->rank != 0 ? J(st->wait_ms) : J()}};
}

nlohmann::ordered_json summary_json(const Run& run, const Summary& s, const Advice& a) {
  nlohmann::ordered_json j = {{"metrics", run.metrics_path},
                              {"config", run.config_path.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(run.config_path)},
                              {"steps", s.steps},
                              {"steps_summarised", s.used},
                              {"warmup_skipped", s.warmup_skipped},
                              {"tokens_per_s", {{"median", s.tps_median}, {"p10", s.tps_p10}, {"p90", s.tps_p90}}},
                              {"mfu_median", s.mfu_median},
                              {"step_ms", s.step_ms},
                              {"unaccounted_ms_raw", s.unaccounted_raw_ms},
                              {"unaccounted_negative", s.unaccounted_raw_ms < 0}};
  for (int p = 0; p < kParts; ++p)
    j["breakdown"][part_key(Part(p))] = {{"ms", s.ms[p]}, {"share", s.share[p]}};
  j["bottleneck"] = {{"part", a.significant ? nlohmann::ordered_json(part_key(a.bottleneck)) : nlohmann::ordered_json()},
                     {"share", s.share[int(a.bottleneck)]},
                     {"straggler", straggler_json(a.straggler)},
                     {"advice", a.lines}};
  return j;
}

nlohmann::ordered_json comparison_json(const std::string& base_path, const Comparison& c) {
  nlohmann::ordered_json j = {{"run", base_path}, {"tolerance", c.tolerance}};
  for (const PartDelta& d : c.parts)
    j["parts"][part_key(d.part)] = {{"base_ms", d.base_ms}, {"run_ms", d.run_ms}, {"delta_ms", d.delta_ms},
                                    {"delta_pct", d.delta_pct}, {"regression", d.regression}};
  j["step_ms"] = {{"base", c.base_step_ms}, {"run", c.run_step_ms}, {"delta_pct", c.step_delta_pct}};
  j["tokens_per_s"] = {{"base", c.base_tps}, {"run", c.run_tps}, {"delta_pct", c.tps_delta_pct},
                       {"regression", c.tps_regression}};
  j["regression"] = c.any_regression();
  return j;
}

// The run's utilisation from --trace (its errors are the report's), or from
// the trace found beside the run (a broken one is a note: the metrics still
// make a report).
struct TraceUtilisation {
  std::optional<Utilisation> util;
  std::string skipped;  // why a trace found beside the run was not used
};
TraceUtilisation trace_utilisation(const Run& run, const std::string& given) {
  TraceUtilisation t;
  const std::string path = find_run_trace(run, given);
  if (path.empty()) return t;
  try {
    t.util = utilisation(load_trace(path));
  } catch (const Error& e) {
    if (!given.empty() || e.kind() != ErrorKind::Data) throw;
    t.skipped = e.what();
  }
  return t;
}

int run_report(const ReportArgs& args) {
  const Run run = load_run(args.run, args.config, args.overrides);
  const Summary s = summarise(run);
  const TraceUtilisation tu = trace_utilisation(run, args.trace);
  const std::optional<Utilisation>& util = tu.util;
  const std::optional<Straggler> straggler = find_straggler(run, s, util ? &*util : nullptr);
  const Advice a = advise(s, run.config ? &*run.config : nullptr, straggler);
  std::optional<Comparison> cmp;
  std::string base_path;
  if (!args.baseline.empty()) {
    const Run base = load_run(args.baseline);
    base_path = base.metrics_path;
    cmp = compare(s, summarise(base), args.tolerance);
  }
  const OpProfile ops = op_profile(run);
  const EnergySummary energy = energy_summary(run);
  std::optional<PlotResult> plots;
  if (!args.plot_dir.empty()) plots = write_plots(run, args.plot_dir);
  if (plots && util && plots->skipped.empty()) {
    const PlotResult u = plot_utilisation(*util, args.plot_dir);
    plots->files.insert(plots->files.end(), u.files.begin(), u.files.end());
    plots->skipped = u.skipped;
  }
  if (plots && plots->skipped.empty() && !(ops.compute.empty() && ops.comm.empty())) {
    const PlotResult o = write_op_plot(ops, args.plot_dir);
    plots->files.insert(plots->files.end(), o.files.begin(), o.files.end());
    plots->skipped = o.skipped;
  }
  if (args.json) {
    nlohmann::ordered_json j = summary_json(run, s, a);
    j["energy"] = energy_json(energy);
    if (ops.steps > 0) j["ops"] = ops_json(ops);
    if (cmp) j["baseline"] = comparison_json(base_path, *cmp);
    if (util) j["utilisation"] = utilisation_json(*util);
    if (!tu.skipped.empty()) j["utilisation_skipped"] = tu.skipped;
    if (plots) j["plots"] = {{"files", plots->files}, {"skipped", plots->skipped}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    print_summary(run, s);
    print_energy(energy);
    print_advice(s, a);
    if (ops.steps > 0) print_ops(ops);
    if (cmp) print_comparison(base_path, *cmp);
    if (util) print_utilisation(*util);
    if (!tu.skipped.empty()) std::printf("\nutilisation skipped: %s\n", tu.skipped.c_str());
    if (plots) print_plots(*plots);
  }
  return cmp && cmp->any_regression() && args.fail_on_regression ? 3 : 0;
}

}  // namespace

int report_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::fputs(kReportUsage, stdout);
      return 0;
    }
  return run_report(parse_args(argc, argv));
}

}  // namespace xirang::tools
