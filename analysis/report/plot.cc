// Plots for `xirang report --plot DIR`: gnuplot runs as a child process on a
// script file; the data goes through temp files. No plotting code of our own.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"
#include "analysis/gnuplot.h"
#include "analysis/report/report.h"

namespace xirang::analysis::report {

namespace fs = std::filesystem;

namespace {

// A private temp directory, removed with everything in it at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "xirang-report-XXXXXX").string();
    if (!::mkdtemp(t.data())) fail(ErrorKind::Data, "report: cannot create a temp directory under ", fs::temp_directory_path().string());
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string gq(const std::string& s) { return analysis::gnuplot_quote(s); }

// Writes the three data files: the per-step breakdown (warm-up skipped),
// tokens/s, and the losses ("?" where a step has no val_loss).
void write_data(const Run& run, const std::string& tmp) {
  std::ofstream b(tmp + "/breakdown.dat"), t(tmp + "/throughput.dat"), l(tmp + "/loss.dat");
  b << "step";
  for (int p = 0; p < kParts; ++p) b << ' ' << part_key(Part(p));
  b << '\n';
  for (size_t i = 0; i < run.steps.size(); ++i) {
    const StepRow& r = run.steps[i];
    if (i > 0 || run.steps.size() == 1) {
      b << r.step;
      for (int p = 0; p < kParts; ++p) b << ' ' << (r.ms[p] > 0 ? r.ms[p] : 0.0);
      b << '\n';
    }
    t << r.step << ' ' << r.tokens_per_s << '\n';
    l << r.step << ' ' << r.loss << ' ';
    if (r.val_loss) l << *r.val_loss << '\n';
    else l << "?\n";
  }
  if (!b || !t || !l) fail(ErrorKind::Data, "report: cannot write plot data under ", tmp);
}

std::string script(const Run& run, const std::string& tmp, const std::string& dir) {
  const size_t n = run.steps.size();
  const int every = int(std::max<size_t>(1, n / 10));
  bool val = false;
  for (const StepRow& r : run.steps) val = val || r.val_loss.has_value();
  std::ostringstream s;
  // One fixed colour per part (gnuplot's cycle repeats after 8); noenhanced keeps '_' literal.
  s << "set terminal pngcairo size 800,420 font ',10' noenhanced\nset datafile missing '?'\nset grid ytics\n"
    << "colors = '#4e79a7 #f28e2b #e15759 #76b7b2 #59a14f #edc948 #b07aa1 #ff9da7 #9c755f #bab0ac'\n"
    << "set xlabel 'step'\n";
  s << "set output " << gq(dir + "/step_breakdown.png") << "\n"
    << "set title 'Step time by part (ms)" << (n > 1 ? ", warm-up step 1 not shown" : "") << "'\n"
    << "set ylabel 'ms'\nset key outside right\nset style data histograms\nset style histogram rowstacked\n"
    // Beyond about 60 bars their outlines would cover the colours.
    << "set style fill solid 0.85 " << (n > 60 ? "noborder" : "border -1") << "\nset boxwidth "
    << (n > 60 ? "1" : "0.8") << "\n"
    << "plot for [i=2:" << kParts + 1 << "] " << gq(tmp + "/breakdown.dat") << " using i:xtic(int($1)%" << every
    << "==0 ? stringcolumn(1) : '') lc rgb word(colors, i-1) title columnheader(i)\n";
  s << "unset style\nset key inside top right\nset xtics autofreq\n";
  s << "set output " << gq(dir + "/tokens_per_s.png") << "\nset title 'Throughput'\nset ylabel 'tokens/s'\n"
    << "set yrange [0:*]\nplot " << gq(tmp + "/throughput.dat") << " using 1:2 with linespoints pt 7 ps 0.5 title 'tokens/s'\n";
  s << "set output " << gq(dir + "/loss.png") << "\nset title 'Loss'\nset ylabel 'loss (nats/token)'\n"
    << "set yrange [*:*]\nplot " << gq(tmp + "/loss.dat") << " using 1:2 with lines lw 2 title 'train loss'";
  if (val) s << ", '' using 1:3 with points pt 7 ps 1.2 title 'val loss'";
  s << "\nunset output\n";
  return s.str();
}

}  // namespace

PlotResult run_gnuplot(const std::string& dir, const std::function<std::string(const std::string&)>& make_script,
                       const std::vector<std::string>& files) {
  PlotResult res;
  const std::string gnuplot = find_gnuplot();
  if (gnuplot.empty()) {
    res.skipped = "gnuplot not found on PATH (install gnuplot-nox; tools/setup.sh does)";
    return res;
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Data, "report: cannot create the plot directory '", dir, "': ", ec.message());
  TempDir tmp;
  std::ofstream(tmp.path + "/plot.gp") << make_script(tmp.path);
  res.skipped = run_gnuplot_script(gnuplot, tmp.path + "/plot.gp");
  if (!res.skipped.empty()) return res;
  for (const std::string& f : files) res.files.push_back(dir + "/" + f);
  return res;
}

PlotResult write_plots(const Run& run, const std::string& dir) {
  return run_gnuplot(
      dir,
      [&](const std::string& tmp) {
        write_data(run, tmp);
        return script(run, tmp, dir);
      },
      {"step_breakdown.png", "tokens_per_s.png", "loss.png"});
}

}  // namespace xirang::analysis::report
