// Per-rank utilisation from a timeline trace: where each rank's traced
// step time went, by the same parts as the metrics.jsonl breakdown.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "analysis/report/trace.h"

namespace xirang::analysis::report {

namespace fs = std::filesystem;

namespace {

struct Interval {
  std::string name;
  double t0 = 0, t1 = 0;  // microseconds
};

// The rank's spans on its training thread (the "compute" track), by start,
// a span before the spans nested in it.
std::vector<Interval> main_spans(const RankTrace& r) {
  std::vector<Interval> v;
  for (const auto& e : r.events)
    if (e.value("ph", "") == "X" && e.value("cat", "") == "compute") {
      const double ts = e["ts"].get<double>();
      v.push_back({e["name"].get<std::string>(), ts, ts + e["dur"].get<double>()});
    }
  std::stable_sort(v.begin(), v.end(),
                   [](const Interval& a, const Interval& b) { return a.t0 != b.t0 ? a.t0 < b.t0 : a.t1 > b.t1; });
  return v;
}

// Sums each span's self time (its time less its children's) into its part,
// for the spans inside a `step` span; returns the step spans' count and total.
std::pair<int, double> attribute(const std::vector<Interval>& spans, std::array<double, kParts>& ms) {
  std::vector<double> self(spans.size());
  std::vector<int> root(spans.size(), -1);
  std::vector<size_t> stack;
  int steps = 0;
  double total = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Interval& s = spans[i];
    while (!stack.empty() && spans[stack.back()].t1 <= s.t0) stack.pop_back();
    self[i] = s.t1 - s.t0;
    if (!stack.empty()) {
      const size_t p = stack.back();
      self[p] -= std::max(0.0, std::min(s.t1, spans[p].t1) - s.t0);  // a child ending past its parent is cut
      root[i] = root[p];
    } else if (s.name == "step") {
      root[i] = int(i);
      ++steps;
      total += s.t1 - s.t0;
    }
    stack.push_back(i);
  }
  for (size_t i = 0; i < spans.size(); ++i)
    if (root[i] >= 0) ms[size_t(span_part(spans[i].name))] += std::max(0.0, self[i]);
  return {steps, total};
}

RankUtilisation rank_utilisation(const RankTrace& r) {
  RankUtilisation u;
  u.rank = r.rank, u.dp = r.dp, u.cp = r.cp, u.tp = r.tp, u.pp = r.pp;
  std::array<double, kParts> us{};
  const auto [steps, total_us] = attribute(main_spans(r), us);
  u.steps = steps;
  if (steps == 0) return u;
  u.step_ms = total_us / 1e3 / steps;
  double sum = 0;
  for (double v : us) sum += v;
  for (int p = 0; p < kParts; ++p) {
    u.ms[size_t(p)] = us[size_t(p)] / 1e3 / steps;
    u.share[size_t(p)] = sum > 0 ? us[size_t(p)] / sum : 0;
  }
  return u;
}

}  // namespace

Part span_part(const std::string& n) {
  if (n == "forward" || n == "backward" || n == "backward_weight" || n == "recompute" || n == "fault_delay")
    return Part::Compute;
  if (n == "tp_all_reduce" || n == "tp_all_gather" || n == "tp_reduce_scatter") return Part::TpComm;
  if (n == "cp_all_gather" || n == "cp_reduce_scatter") return Part::CpComm;
  if (n == "optimizer") return Part::Optimizer;
  if (n == "data_wait") return Part::DataWait;
  if (n == "wait_activation" || n == "wait_gradient" || n == "pipeline_drain") return Part::PpBubble;
  if (n == "wait_send" || n == "tied_all_reduce") return Part::PpExposed;
  if (n == "dp_wait") return Part::DpExposed;
  if (n == "checkpoint_save" || n == "checkpoint_snapshot") return Part::CkptStall;
  return Part::Unaccounted;  // the step itself, loss_all_reduce, names this version does not know
}

Utilisation utilisation(const Trace& t) {
  Utilisation u;
  u.source = t.source;
  u.first_step = t.first_step;
  u.last_step = t.last_step;
  for (const RankTrace& r : t.ranks) u.ranks.push_back(rank_utilisation(r));
  return u;
}

std::string find_run_trace(const Run& run, const std::string& given) {
  if (!given.empty()) return given;
  std::error_code ec;
  const fs::path dir = fs::path(run.metrics_path).parent_path() / "trace";
  if (!fs::is_directory(dir, ec)) return {};
  if (fs::exists(dir / "trace.json", ec)) return dir.string();
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("rank_", 0) == 0) return dir.string();
  return {};
}

bool has_cp(const Utilisation& u) {
  return std::any_of(u.ranks.begin(), u.ranks.end(), [](const RankUtilisation& r) { return r.cp > 0; });
}

std::string rank_axis(bool with_cp) { return with_cp ? "rank (dp,cp,tp,pp)" : "rank (dp,tp,pp)"; }

std::string rank_label(const RankUtilisation& r, bool with_cp) {
  return with_cp ? str_cat(r.rank, " (", r.dp, ',', r.cp, ',', r.tp, ',', r.pp, ')')
                 : str_cat(r.rank, " (", r.dp, ',', r.tp, ',', r.pp, ')');
}

PlotResult plot_utilisation(const Utilisation& u, const std::string& dir) {
  const bool with_cp = has_cp(u);
  auto make = [&](const std::string& tmp) {
    std::ofstream d(tmp + "/utilisation.dat");
    d << "rank";
    for (int p = 0; p < kParts; ++p) d << ' ' << part_key(Part(p));
    d << '\n';
    for (const RankUtilisation& r : u.ranks) {
      d << '"' << rank_label(r, with_cp) << '"';
      for (double s : r.share) d << ' ' << 100 * s;
      d << '\n';
    }
    std::ostringstream s;
    s << "set terminal pngcairo size " << std::max(640, 120 + 40 * int(u.ranks.size()))
      << ",440 font ',10' noenhanced\nset grid ytics\n"
      << "colors = '#4e79a7 #f28e2b #e15759 #76b7b2 #59a14f #edc948 #b07aa1 #ff9da7 #9c755f #bab0ac'\n"
      << "set output " << gnuplot_quote(dir + "/utilisation.png") << "\n"
      << "set title 'Traced steps " << u.first_step << "-" << u.last_step << ": share of step time per rank'\n"
      << "set xlabel '" << rank_axis(with_cp) << "'\nset ylabel '% of step time'\nset yrange [0:100]\n"
      << "set key outside right\nset style data histograms\nset style histogram rowstacked\n"
      << "set style fill solid 0.85 border -1\nset boxwidth 0.8\nset xtics rotate by -30\n"
      << "plot for [i=2:" << kParts + 1 << "] " << gnuplot_quote(tmp + "/utilisation.dat")
      << " using i:xtic(1) lc rgb word(colors, i-1) title columnheader(i)\nunset output\n";
    return s.str();
  };
  return run_gnuplot(dir, make, {"utilisation.png"});
}

}  // namespace xirang::analysis::report
