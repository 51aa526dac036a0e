#include "analysis/plan/calibrate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace xirang::analysis::plan {

namespace {

using nlohmann::json;

double field(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) fail(ErrorKind::Data, where, ": missing number '", key, "'");
  return it->get<double>();
}

SweepPoint parse_point(const json& j, const std::string& where) {
  if (!j.contains("model") || !j.contains("layout")) fail(ErrorKind::Data, where, ": missing 'model' or 'layout'");
  const json &m = j["model"], &l = j["layout"];
  Config cfg;
  cfg.model.arch = m.value("arch", std::string("gpt2"));
  cfg.model.n_layer = int(field(m, "n_layer", where));
  cfg.model.d_model = int(field(m, "d_model", where));
  cfg.model.n_head = int(field(m, "n_head", where));
  cfg.model.max_seq_len = int(field(m, "seq_len", where));
  cfg.model.vocab_size = int(field(m, "vocab_size", where));
  cfg.train.global_batch = int(field(l, "global_batch", where));
  const std::string prec = j.value("precision", std::string("fp32"));
  cfg.precision.dtype = prec == "bf16" ? Precision::BF16 : prec == "fp16" ? Precision::FP16 : Precision::FP32;
  const std::string rc = l.value("recompute", std::string("none"));  // rows of older sweeps have no field
  const std::optional<Recompute> recompute = parse_config_name<Recompute>(rc);
  if (!recompute)
    fail(ErrorKind::Data, where, ": layout.recompute is '", rc, "', expected one of ", config_names_text<Recompute>());
  cfg.train.recompute = *recompute;
  // Rows of older sweeps have no field.
  cfg.parallel.schedule = parse_schedule(l.value("schedule", std::string("1f1b")), str_cat(where, ": layout.schedule"));
  SweepPoint p;
  p.layout.dp = int(field(l, "dp", where));
  p.layout.cp = int(l.value("cp", 1));  // rows of older sweeps have no field
  p.layout.tp = int(field(l, "tp", where));
  p.layout.pp = int(field(l, "pp", where));
  p.layout.virtual_stages = int(l.value("virtual_stages", 1));
  p.layout.micro_batch = int(field(l, "micro_batch", where));
  p.layout.zero = int(l.value("zero", 0));
  p.layout.sequence_parallel = l.value("sequence_parallel", false);
  p.layout.recompute = cfg.train.recompute;
  p.id = j.value("id", where);
  p.index = int(j.value("point", 0));
  p.step_s = field(j, "step_ms_median", where) / 1e3;
  if (j.contains("host") && j["host"].is_object() && j["host"].contains("cpu_wait_share") &&
      j["host"]["cpu_wait_share"].is_number())
    p.cpu_wait_share = j["host"]["cpu_wait_share"].get<double>();
  if (j.contains("breakdown_ms") && j["breakdown_ms"].is_object()) {
    const json& b = j["breakdown_ms"];
    const double f = b.value("forward_ms", 0.0), bw = b.value("backward_ms", 0.0);
    // A recomputing backward holds a forward (or its attention core): only
    // rows without recomputation give the backward's ratio.
    if (f > 0 && bw > 0 && cfg.train.recompute == Recompute::None) p.backward_ratio = bw / f;
    if (f > 0 && bw > 0) p.compute_s = (f + bw) / 1e3;
  }
  p.workload = workload_of(cfg);
  return p;
}

// The constants the fit moves, as references into a cluster.
std::vector<std::function<double&(Cluster&)>> fitted_constants() {
  return {[](Cluster& c) -> double& { return c.peak_tflops_fp32; },
          [](Cluster& c) -> double& { return c.matmul_half_width; },
          [](Cluster& c) -> double& { return c.op_overhead_us; },
          [](Cluster& c) -> double& { return c.memory_bandwidth_gbps; },
          [](Cluster& c) -> double& { return c.intra_node.bandwidth_gbps; },
          [](Cluster& c) -> double& { return c.intra_node.latency_us; },
          [](Cluster& c) -> double& { return c.rank_skew; }};
}

Cluster with(const Cluster& start, const std::vector<double>& logs) {
  Cluster c = start;
  auto k = fitted_constants();
  for (size_t i = 0; i < k.size(); ++i) k[i](c) = std::exp(logs[i]);
  if (c.peak_tflops <= c.peak_tflops_fp32) c.peak_tflops = c.peak_tflops_fp32;
  return c;
}

// Residuals: log(predicted/measured) per fitted point, then the pull toward the start.
std::vector<double> residuals(const std::vector<const SweepPoint*>& pts, const Cluster& start,
                              const std::vector<double>& logs, const std::vector<double>& logs0) {
  const Cluster c = with(start, logs);
  std::vector<double> r;
  // Each point's step time, and its compute alone where the row has it
  // (rank 0's, so pipeline stage 0's):
  // fitting the sum only lets a compute rate that is off trade against the
  // communication and bubble terms, which then fail on layouts that lack them.
  constexpr double kCompute = 1.0;  // weight of log(predicted / measured compute), as a step time's
  for (const SweepPoint* p : pts) {
    const StepTime t = predict_point_times(*p, c);
    r.push_back(std::log(t.step_s / p->step_s));
    if (p->compute_s > 0) r.push_back(kCompute * std::log(t.first_stage_compute_s / p->compute_s));
  }
  constexpr double kPull = 0.05;  // weight of log(constant / start value)
  for (size_t i = 0; i < logs.size(); ++i) r.push_back(kPull * (logs[i] - logs0[i]));
  return r;
}

double sumsq(const std::vector<double>& r) {
  double s = 0;
  for (double x : r) s += x * x;
  return s;
}

// Solves (A + mu diag(A)) x = b for small dense A (Gaussian elimination with pivoting).
std::vector<double> solve(std::vector<std::vector<double>> A, std::vector<double> b) {
  const size_t n = b.size();
  for (size_t i = 0; i < n; ++i) {
    size_t piv = i;
    for (size_t r = i + 1; r < n; ++r)
      if (std::fabs(A[r][i]) > std::fabs(A[piv][i])) piv = r;
    std::swap(A[i], A[piv]);
    std::swap(b[i], b[piv]);
    for (size_t r = i + 1; r < n; ++r) {
      const double f = A[r][i] / A[i][i];
      for (size_t k = i; k < n; ++k) A[r][k] -= f * A[i][k];
      b[r] -= f * b[i];
    }
  }
  std::vector<double> x(n);
  for (size_t i = n; i-- > 0;) {
    double s = b[i];
    for (size_t k = i + 1; k < n; ++k) s -= A[i][k] * x[k];
    x[i] = s / A[i][i];
  }
  return x;
}

// Levenberg-Marquardt over the log constants.
std::vector<double> fit(const std::vector<const SweepPoint*>& pts, const Cluster& start, std::vector<double> x) {
  const std::vector<double> x0 = x;
  double mu = 1e-2;
  std::vector<double> r = residuals(pts, start, x, x0);
  for (int it = 0; it < 60; ++it) {
    const size_t n = x.size(), m = r.size();
    std::vector<std::vector<double>> J(m, std::vector<double>(n));
    for (size_t k = 0; k < n; ++k) {
      std::vector<double> xs = x;
      xs[k] += 1e-4;
      const std::vector<double> rs = residuals(pts, start, xs, x0);
      for (size_t i = 0; i < m; ++i) J[i][k] = (rs[i] - r[i]) / 1e-4;
    }
    std::vector<std::vector<double>> A(n, std::vector<double>(n, 0));
    std::vector<double> g(n, 0);
    for (size_t i = 0; i < m; ++i)
      for (size_t a = 0; a < n; ++a) {
        g[a] -= J[i][a] * r[i];
        for (size_t b = 0; b < n; ++b) A[a][b] += J[i][a] * J[i][b];
      }
    for (size_t a = 0; a < n; ++a) A[a][a] *= 1 + mu;
    const std::vector<double> d = solve(A, g);
    std::vector<double> xn = x;
    for (size_t a = 0; a < n; ++a) xn[a] += std::clamp(d[a], -2.0, 2.0);
    const std::vector<double> rn = residuals(pts, start, xn, x0);
    if (sumsq(rn) < sumsq(r)) {
      const bool done = sumsq(r) - sumsq(rn) < 1e-10;
      x = xn, r = rn, mu = std::max(mu / 3, 1e-6);
      if (done) break;
    } else {
      mu *= 10;
      if (mu > 1e8) break;
    }
  }
  return x;
}

double median_abs(const std::vector<PointError>& e) {
  if (e.empty()) return 0;
  std::vector<double> v;
  for (const PointError& p : e) v.push_back(std::fabs(p.error()));
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

std::vector<SweepPoint> read_sweep(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(ErrorKind::Data, "plan: cannot read sweep results '", path, "'");
  std::vector<SweepPoint> pts;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json j = json::parse(line, nullptr, false);
    const std::string where = str_cat(path, " line ", n);
    if (j.is_discarded() || !j.is_object()) fail(ErrorKind::Data, where, " is not a JSON object");
    if (j.value("status", std::string()) != "ok") continue;
    pts.push_back(parse_point(j, where));
  }
  if (pts.size() < 2) fail(ErrorKind::Data, "plan: ", path, " has ", pts.size(), " measured points; calibration needs at least 2");
  return pts;
}

Holdout parse_holdout(const std::string& s) {
  if (s == "odd") return Holdout::Odd;
  if (s == "even") return Holdout::Even;
  if (s == "none") return Holdout::None;
  fail(ErrorKind::Usage, "plan: --holdout must be odd, even or none, got '", s, "'");
}

double predict_point(const SweepPoint& p, const Cluster& c) { return predict_point_times(p, c).step_s; }

StepTime predict_point_times(const SweepPoint& p, const Cluster& c) {
  Cluster any = c;
  any.devices_per_node = std::max(c.devices_per_node, p.layout.tp);  // a point measured is a point that ran
  any.nodes = 0;
  const Prediction pr = predict_time(p.workload, p.layout, any, Features{});
  if (!pr.problem.empty()) fail(ErrorKind::Data, "sweep point ", p.id, ": ", pr.problem);
  return pr.time;
}

CalibrationResult calibrate(const std::vector<SweepPoint>& points, const Cluster& start, Holdout holdout) {
  std::vector<const SweepPoint*> fit_set, held;
  for (size_t i = 0; i < points.size(); ++i) {
    const bool out = (holdout == Holdout::Odd && i % 2 == 1) || (holdout == Holdout::Even && i % 2 == 0);
    (out ? held : fit_set).push_back(&points[i]);
  }
  Cluster s = start;
  if (s.peak_tflops_fp32 <= 0) s.peak_tflops_fp32 = s.peak_tflops;
  if (s.matmul_half_width <= 0) s.matmul_half_width = 64;
  if (s.op_overhead_us <= 0) s.op_overhead_us = 10;
  if (s.intra_node.latency_us <= 0) s.intra_node.latency_us = 1;
  if (s.rank_skew <= 0) s.rank_skew = 0.02;
  // The backward's time per forward is measured directly (each row's
  // breakdown), not fitted: step times alone hardly tell it from the rate.
  std::vector<double> ratios;
  for (const SweepPoint* p : fit_set)
    if (p->backward_ratio > 0) ratios.push_back(p->backward_ratio);
  if (!ratios.empty()) {
    std::sort(ratios.begin(), ratios.end());
    const size_t n = ratios.size();
    s.backward_factor = n % 2 ? ratios[n / 2] : (ratios[n / 2 - 1] + ratios[n / 2]) / 2;
  }
  std::vector<double> x0;
  for (auto& k : fitted_constants()) x0.push_back(std::log(k(s)));
  // Several starting latencies: on a machine whose collectives wait for
  // busy peers, the effective latency can be 100x the nominal one, and the
  // fit otherwise stops in the local minimum next to the start.
  std::vector<double> x;
  double best = 0;
  for (double scale : {1.0, 10.0, 100.0}) {
    std::vector<double> start_x = x0;
    start_x[5] += std::log(scale);
    const std::vector<double> got = fit(fit_set, s, start_x);
    const double cost = sumsq(residuals(fit_set, s, got, x0));
    if (x.empty() || cost < best) x = got, best = cost;
  }
  CalibrationResult r;
  r.cluster = with(s, x);
  r.fit_points = int(fit_set.size());
  r.backward_points = int(ratios.size());
  for (const SweepPoint* p : fit_set)
    r.fitted.push_back({p->id, p->step_s, predict_point(*p, r.cluster), p->cpu_wait_share});
  for (const SweepPoint* p : held) r.held_out.push_back({p->id, p->step_s, predict_point(*p, r.cluster), p->cpu_wait_share});
  for (const SweepPoint& p : points) r.contended_points += p.cpu_wait_share > sweep::kContendedShare;
  r.fit_median_error = median_abs(r.fitted);
  r.held_out_median_error = median_abs(r.held_out);
  for (const PointError& e : r.held_out) r.held_out_max_error = std::max(r.held_out_max_error, std::fabs(e.error()));
  return r;
}

std::string calibration_report(const CalibrationResult& r) {
  std::string s;
  char buf[256];
  auto rows = [&](const char* title, const std::vector<PointError>& v) {
    s += title;
    for (const PointError& e : v) {
      std::snprintf(buf, sizeof buf, "  %-48s measured %9.2f ms  predicted %9.2f ms  %+6.1f%%", e.id.c_str(),
                    e.measured_s * 1e3, e.predicted_s * 1e3, 100 * e.error());
      s += buf;
      if (e.cpu_wait_share > sweep::kContendedShare)
        s += str_cat("  (waited for a core ", int(100 * e.cpu_wait_share + 0.5), "% of the step)");
      s += "\n";
    }
  };
  if (r.backward_points > 0) {
    std::snprintf(buf, sizeof buf, "backward_factor %.3f: the median backward_ms / forward_ms of %d fitted point(s)\n",
                  r.cluster.backward_factor, r.backward_points);
    s += buf;
  }
  rows("fitted points:\n", r.fitted);
  if (!r.held_out.empty()) rows("held-out points:\n", r.held_out);
  std::snprintf(buf, sizeof buf, "median |error|: fitted %.1f%%, held out %.1f%% (max %.1f%%)\n",
                100 * r.fit_median_error, 100 * r.held_out_median_error, 100 * r.held_out_max_error);
  s += buf;
  if (r.contended_points > 0)
    s += str_cat("warning: ", r.contended_points, " point(s) waited for a core over ", int(100 * sweep::kContendedShare),
                 "% of their step time: that waiting depends on the layout (ranks that block in collectives give "
                 "their core to others), so the fit describes the machine's other load as much as the machine; "
                 "measure on free cores (a quiet machine, or the sweep spec's priority as root)\n");
  return s;
}

}  // namespace xirang::analysis::plan
