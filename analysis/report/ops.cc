// The per-op profile of a run (metrics.op_profile): median time and calls
// per step of each kind of op, compute and communication apart.
#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

#include "analysis/report/report.h"

namespace xirang::analysis::report {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

OpProfile op_profile(const Run& run) {
  OpProfile p;
  std::vector<const StepRow*> rows;
  for (const StepRow& r : run.steps)
    if (r.has_ops) rows.push_back(&r);
  // The first step pays one-time costs, as in summarise(); step 1 only, so a
  // run resumed from a checkpoint keeps its first step.
  if (rows.size() > 1 && rows.front()->step == 1) rows.erase(rows.begin());
  p.steps = int(rows.size());
  if (rows.empty()) return p;
  std::vector<double> step_ms;
  for (const StepRow* r : rows) step_ms.push_back(r->step_ms);
  p.step_ms = median(step_ms);
  for (int k = 0; k < kOpKindCount; ++k) {
    std::vector<double> ms, calls;
    bool seen = false;
    for (const StepRow* r : rows) {
      ms.push_back(r->op_ms[size_t(k)]);
      calls.push_back(r->op_calls[size_t(k)]);
      seen = seen || r->op_calls[size_t(k)] > 0 || r->op_ms[size_t(k)] > 0;
    }
    if (!seen) continue;
    OpRow row{OpKind(k), median(ms), 0, median(calls)};
    row.share = p.step_ms > 0 ? row.ms / p.step_ms : 0;
    if (op_kind_is_comm(row.kind)) {
      p.comm.push_back(row);
    } else {
      p.compute.push_back(row);
      p.compute_ms += row.ms;
    }
  }
  p.compute_share = p.step_ms > 0 ? p.compute_ms / p.step_ms : 0;
  return p;
}

PlotResult write_op_plot(const OpProfile& ops, const std::string& dir) {
  auto make = [&](const std::string& tmp) {
    std::ofstream d(tmp + "/ops.dat");
    int i = 0;
    for (const auto* rows : {&ops.compute, &ops.comm})
      for (const OpRow& r : *rows) d << i++ << ' ' << op_kind_name(r.kind) << ' ' << r.ms << ' ' << (rows == &ops.comm) << '\n';
    std::ostringstream s;
    s << "set terminal pngcairo size 800,420 font ',10' noenhanced\nset grid ytics\n"
      << "set output " << gnuplot_quote(dir + "/ops.png") << "\n"
      << "set title 'Time per op kind (median ms per step over " << ops.steps
      << " steps; communication is in flight and overlaps compute)'\n"
      << "set ylabel 'ms per step'\nset yrange [0:*]\nset style fill solid 0.85 border -1\nset boxwidth 0.7\n"
      << "set xtics rotate by -35\nset key inside top right\n"
      << "plot " << gnuplot_quote(tmp + "/ops.dat");
    if (!ops.compute.empty()) s << " using 1:($4 == 0 ? $3 : 1/0):xtic(2) with boxes lc rgb '#4e79a7' title 'compute'";
    if (!ops.compute.empty() && !ops.comm.empty()) s << ", ''";
    if (!ops.comm.empty())
      s << " using 1:($4 == 1 ? $3 : 1/0):xtic(2) with boxes lc rgb '#f28e2b' title 'communication (in flight)'";
    s << "\nunset output\n";
    return s.str();
  };
  return run_gnuplot(dir, make, {"ops.png"});
}

}  // namespace xirang::analysis::report
