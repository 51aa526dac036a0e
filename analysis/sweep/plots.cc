// Plots of a sweep through gnuplot: the data files and the script stay in
// DIR (plots/*.dat, plots/plots.gp) so a plot can be redrawn or restyled by
// hand. No plotting code of our own.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"
#include "runtime/step/schedule.h"
#include "analysis/gnuplot.h"
#include "analysis/sweep/sweep.h"

namespace xirang::analysis::sweep {

namespace fs = std::filesystem;

namespace {

std::string gq(const std::string& s) { return gnuplot_quote(s); }

const char* kHeader =
    "set terminal pngcairo size 900,480 font ',10' noenhanced\nset datafile missing '?'\nset grid ytics\n"
    "colors = '#4e79a7 #f28e2b #e15759 #76b7b2 #59a14f #edc948 #b07aa1 #ff9da7 #9c755f #bab0ac #d37295'\n";

// The ten disjoint parts of a step (dp_comm_ms overlaps backward and is left out).
std::vector<std::string> parts() {
  std::vector<std::string> p;
  for (const std::string& k : breakdown_keys())
    if (k != "dp_comm_ms") p.push_back(k);
  return p;
}

// points.dat: one line per ok point: its id, tokens/s, and the parts' medians.
std::string points_plots(const std::vector<Json>& rows, const std::string& dir) {
  std::ofstream d(dir + "/points.dat");
  d << "id tokens_per_s";
  for (const std::string& k : parts()) d << ' ' << k.substr(0, k.size() - 3);
  d << '\n';
  int n = 0;
  size_t longest = 0;
  for (const Json& r : rows) {
    if (r["status"] != "ok") continue;
    ++n;
    longest = std::max(longest, r["id"].get<std::string>().size());
    d << r["id"].get<std::string>() << ' ' << r["tokens_per_s"].get<double>();
    for (const std::string& k : parts()) d << ' ' << std::max(0.0, r["breakdown_ms"][k].get<double>());
    d << '\n';
  }
  if (n == 0) return {};
  const std::string data = gq("points.dat");
  std::ostringstream s;
  // Room below the bars for the ids, written at an angle.
  const size_t label_lines = 2 + longest * 4 / 10;
  s << "set terminal pngcairo size 900," << 380 + 16 * label_lines << " font ',10' noenhanced\n"
    << "set style data histograms\nset style fill solid 0.85 border -1\nset boxwidth 0.8\n"
    << "set xtics rotate by -40 left\nset bmargin " << label_lines << "\n";
  s << "set output " << gq("tokens_per_s.png") << "\nset title 'Throughput per point (median)'\n"
    << "set ylabel 'tokens/s'\nset yrange [0:*]\nunset key\n"
    << "plot " << data << " using 2:xtic(1) lc rgb '#4e79a7'\n";
  s << "set output " << gq("step_breakdown.png") << "\nset title 'Step time by part (medians)'\n"
    << "set ylabel 'ms'\nset key outside right\nset style histogram rowstacked\n"
    << "plot for [i=3:" << parts().size() + 2 << "] " << data
    << " using i:xtic(1) lc rgb word(colors, i-2) title columnheader(i)\n";
  s << "unset style\nset style data linespoints\nset xtics norotate\nset bmargin\nset key inside\n"
    << "set terminal pngcairo size 900,480 font ',10' noenhanced\n";
  return s.str();
}

std::string scaling_plot(const std::vector<Json>& rows, const std::string& dir) {
  const std::vector<ScalingSeries> series = scaling_series(rows);
  if (series.empty()) return {};
  std::ostringstream s;
  int max_ranks = 1;
  s << "set output " << gq("scaling.png") << "\nset title 'Scaling efficiency: tokens/s per rank against the fewest ranks'\n"
    << "set xlabel 'ranks'\nset ylabel 'efficiency (%)'\nset logscale x 2\nset yrange [0:110]\nset key outside right\nplot ";
  for (size_t i = 0; i < series.size(); ++i) {
    const std::string f = "scaling_" + std::to_string(i + 1) + ".dat";
    std::ofstream d(dir + "/" + f);
    for (const ScalingPoint& p : series[i].points) {
      d << p.ranks << ' ' << 100 * p.efficiency << '\n';
      max_ranks = std::max(max_ranks, p.ranks);
    }
    s << (i ? ", " : "") << gq(f) << " using 1:2 with linespoints pt 7 lw 2 dt " << (series[i].weak ? 2 : 1)
      << " title " << gq(series[i].label);
  }
  s << ", 100 with lines lc rgb 'gray' dt 3 title 'ideal'\nunset logscale x\nset xrange [*:*]\n";
  return s.str();
}

// One plot per pipeline size: measured bubble points per schedule, the
// simulator's curve and the analytic one over the microbatch counts.
std::string bubble_plots(const std::vector<Json>& rows, const std::string& dir) {
  const std::vector<BubbleRow> bubbles = bubble_rows(rows);
  std::map<int, std::map<std::string, std::vector<BubbleRow>>> by;  // pp -> "schedule v" -> rows
  for (const BubbleRow& b : bubbles) by[b.pp][b.schedule + " v" + std::to_string(b.v)].push_back(b);
  std::ostringstream s;
  for (const auto& [pp, groups] : by) {
    s << "set output " << gq("bubble_pp" + std::to_string(pp) + ".png") << "\nset title 'Pipeline bubble, pp="
      << pp << ": measured (points), simulator (lines), analytic (dashed)'\n"
      << "set xlabel 'microbatches per step'\nset ylabel 'bubble (% of the pipeline time)'\nset yrange [0:*]\n"
      << "set key outside right\nplot ";
    int color = 1;
    for (const auto& [name, list] : groups) {
      const std::string tag = "bubble_pp" + std::to_string(pp) + "_" + list[0].schedule + "_v" + std::to_string(list[0].v);
      std::ofstream meas(dir + "/" + tag + "_measured.dat"), model(dir + "/" + tag + "_model.dat");
      int max_m = 1;
      double ratio = 0;
      for (const BubbleRow& b : list) {
        meas << b.m << ' ' << 100 * b.measured << '\n';
        max_m = std::max(max_m, b.m);
        ratio += b.backward_over_forward / double(list.size());
      }
      for (int m = 1; m <= max_m; ++m) {
        const double sim = simulated_bubble(list[0].schedule, pp, m, list[0].v, ratio);
        const double ana = analytic_bubble(parse_schedule(list[0].schedule, "parallel.schedule"), pp, m, list[0].v);
        model << m << ' ' << (sim < 0 ? std::string("?") : std::to_string(100 * sim)) << ' ' << 100 * ana << '\n';
      }
      s << (color > 1 ? ", " : "") << gq(tag + "_measured.dat") << " using 1:2 with points pt 7 ps 1.5 lc rgb word(colors, "
        << color << ") title " << gq(name + " measured") << ", " << gq(tag + "_model.dat")
        << " using 1:2 with linespoints pt 1 lw 2 lc rgb word(colors, " << color << ") title " << gq(name + " simulated")
        << ", '' using 1:3 with lines dt 2 lc rgb word(colors, " << color << ") title " << gq(name + " analytic");
      ++color;
    }
    s << "\n";
  }
  return s.str();
}

std::vector<std::string> outputs(const std::string& script, const std::string& dir) {
  std::vector<std::string> files;
  std::istringstream in(script);
  for (std::string l; std::getline(in, l);)
    if (l.rfind("set output '", 0) == 0) files.push_back(dir + "/" + l.substr(12, l.size() - 13));
  return files;
}

}  // namespace

PlotResult write_plots(const std::vector<Json>& rows, const std::string& dir) {
  PlotResult res;
  const std::string gnuplot = find_gnuplot();
  if (gnuplot.empty()) {
    res.skipped = "gnuplot not found on PATH (install gnuplot-nox; tools/setup.sh does); the tables above hold the numbers";
    return res;
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Data, "sweep: cannot create the plot directory '", dir, "': ", ec.message());
  const std::string body = points_plots(rows, dir) + scaling_plot(rows, dir) + bubble_plots(rows, dir);
  if (body.empty()) {
    res.skipped = "no point ended ok: nothing to plot";
    return res;
  }
  // The script names its files relative to DIR: `cd DIR && gnuplot plots.gp` redraws them.
  std::ofstream(dir + "/plots.gp") << kHeader << body << "unset output\n";
  res.skipped = run_gnuplot_script(gnuplot, "plots.gp", dir);
  if (!res.skipped.empty()) return res;
  res.files = outputs(body, dir);
  return res;
}

}  // namespace xirang::analysis::sweep
