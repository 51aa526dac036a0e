// The dominant bottleneck and what to change, computed from the run and its
// config; the comparison with a baseline run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "runtime/step/schedule.h"
#include "analysis/report/report.h"
#include "analysis/format.h"

namespace xirang::analysis::report {

namespace {

// The simulator's bubble for one layout, or a negative value when the
// schedule does not support it (interleaved needs m % p == 0).
double simulated_bubble(ScheduleKind kind, int p, int m, int v) {
  try {
    SimCosts costs;  // backward twice the forward, as in a transformer
    SimResult r = simulate(kind, p, m, v, costs);
    return r.ok ? r.bubble_fraction : -1;
  } catch (const Error&) {
    return -1;
  }
}

void bubble_advice(const Summary& s, const Config* cfg, std::vector<std::string>& out) {
  const std::string need = "the simulator's prediction needs parallel.pp, parallel.schedule and the microbatch count";
  if (!cfg) return out.push_back(need + ": give the run's config (--config FILE [--set k=v])");
  const ParallelConfig& par = cfg->parallel;
  if (par.dp <= 0)
    return out.push_back(need + ": parallel.dp is inferred from the world size; add --set parallel.dp=N");
  const int p = par.pp, m = cfg->microbatches(), v = par.virtual_stages;
  const ScheduleKind kind = par.schedule;
  if (p <= 1) return out.push_back("parallel.pp=1: the time counted as bubble is not a pipeline's fill and drain");
  out.push_back(format("measured bubble %.1f%% of the step; the simulator predicts %.1f%% (analytic %.1f%%)",
                    100 * s.share[int(Part::PpBubble)], 100 * simulated_bubble(kind, p, m, v),
                    100 * analytic_bubble(kind, p, m, v)) +
                " for " + schedule_name(par.schedule) + ", pp=" + std::to_string(p) + ", " + std::to_string(m) + " microbatches");
  for (int k : {2, 4}) {
    const double b = simulated_bubble(kind, p, k * m, v);
    if (b >= 0)
      out.push_back(format("%.0f microbatches (train.global_batch=%.0f): simulated bubble %.1f%%", double(k * m),
                        double(k * cfg->train.global_batch), 100 * b));
  }
  const int v2 = kind == ScheduleKind::Interleaved ? 2 * v : 2;
  if (cfg->model.n_layer % (p * v2) == 0) {
    const double b = simulated_bubble(ScheduleKind::Interleaved, p, m, v2);
    if (b >= 0)
      out.push_back(format("parallel.schedule=interleaved with parallel.virtual_stages=%.0f: simulated bubble %.1f%%",
                        double(v2), 100 * b));
  }
  // The split backward fills the cool-down with weight-gradient work at
  // 1F1B's peak of microbatches in flight (its activation plan is larger:
  // docs/pipeline_schedules.md).
  if (kind != ScheduleKind::ZeroBubbleH1 && v == 1) {
    const double b = simulated_bubble(ScheduleKind::ZeroBubbleH1, p, m, 1);
    if (b >= 0)
      out.push_back(format("parallel.schedule=zb_h1 (the backward split, its weight part filling the bubble): simulated "
                        "bubble %.1f%%, with about twice 1F1B's activation memory",
                        100 * b));
  }
}

void dp_advice(const Summary& s, const Config* cfg, std::vector<std::string>& out) {
  const double exposed = s.ms[int(Part::DpExposed)];
  if (s.dp_comm_ms > 0)
    out.push_back(format("dp communication takes %.2f ms a step, %.2f ms of it exposed (%.0f%% hidden behind backward)",
                      s.dp_comm_ms, exposed, 100 * (1 - exposed / s.dp_comm_ms)));
  if (cfg && !cfg->parallel.overlap_grad_reduce)
    return out.push_back("set parallel.overlap_grad_reduce=true: buckets reduce during the backward pass");
  const double mb = cfg ? cfg->parallel.bucket_mb : 25;
  out.push_back(format("lower parallel.bucket_mb from %g to %g: the first bucket's reduction starts earlier in the "
                    "backward pass, so less of it is left after the last gradient",
                    mb, mb / 2));
  if (!cfg) out.push_back("(with the run's config, --config FILE, the advice uses its bucket size and overlap setting)");
}

void data_advice(const Summary& s, const Config* cfg, std::vector<std::string>& out) {
  out.push_back(format("the step waits %.2f ms for input (%.1f%% of the step): the loader is slower than training",
                    s.ms[int(Part::DataWait)], 100 * s.share[int(Part::DataWait)]));
  if (cfg && !cfg->data.prefetch)
    out.push_back("set data.prefetch=true: loader threads prepare microbatches while the step computes");
  const int threads = cfg ? cfg->data.loader_threads : 2, depth = cfg ? cfg->data.prefetch_max : 8;
  out.push_back(format("raise data.loader_threads from %.0f to %.0f and data.prefetch_max from %.0f", double(threads),
                    double(2 * threads), double(depth)) +
                format(" to %.0f (the prefetch depth)", double(2 * depth)));
}

void ckpt_advice(const Summary& s, const Config* cfg, std::vector<std::string>& out) {
  const double stall = s.ms[int(Part::CkptStall)];
  if (!cfg || !cfg->checkpoint.async) out.push_back("set checkpoint.async=true: snapshot to host memory, write in the background");
  if (!cfg || cfg->checkpoint.every <= 0) {
    out.push_back("raise checkpoint.every so that fewer steps stop to save");
    return;
  }
  const double per_save = stall * cfg->checkpoint.every;  // the stall is averaged over all steps
  const double every = std::ceil(per_save / (0.01 * s.step_ms));
  out.push_back(format("each save stops training about %.0f ms; checkpoint.every=%.0f", per_save,
                    double(cfg->checkpoint.every)) +
                format(" -> %.0f keeps the stall under 1%% of the time", every));
}

void other_advice(Part p, const Config* cfg, std::vector<std::string>& out) {
  switch (p) {
    case Part::Optimizer:
      if (!cfg || (cfg->parallel.zero == 0 && cfg->parallel.dp != 1))
        out.push_back("parallel.zero=1 shards the optimizer state and its update over the dp ranks");
      break;
    case Part::TpComm:
      out.push_back("tensor-parallel communication blocks compute: keep parallel.tp within a node, try "
                    "parallel.sequence_parallel=true, or trade tp for dp or pp");
      break;
    case Part::CpComm:
      out.push_back("context-parallel key/value exchange blocks compute: keep parallel.cp on fast links (it is placed "
                    "right after tp), lower parallel.cp if memory allows, or use grouped-query attention (fewer "
                    "key/value heads to gather)");
      break;
    case Part::PpExposed:
      out.push_back("pipeline sends wait on the link: fewer, larger microbatches (train.micro_batch) send fewer messages");
      break;
    default:
      out.push_back("time the trainer does not attribute (host bookkeeping, logging, synchronisation): "
                    "a trace (metrics trace files) shows where it goes");
  }
}

void part_advice(Part p, const Summary& s, const Config* cfg, std::vector<std::string>& out) {
  switch (p) {
    case Part::PpBubble: bubble_advice(s, cfg, out); break;
    case Part::DpExposed: dp_advice(s, cfg, out); break;
    case Part::DataWait: data_advice(s, cfg, out); break;
    case Part::CkptStall: ckpt_advice(s, cfg, out); break;
    default: other_advice(p, cfg, out);
  }
}

// The straggler is the cause; the part rank 0 waits in is its symptom, and
// that part's own advice (smaller buckets, more microbatches) moves work
// around the wait without shortening it.
void straggler_advice(const Summary& s, const Config* cfg, const Straggler& st, std::vector<std::string>& out) {
  const std::string who = "rank " + std::to_string(st.rank);
  const std::string ratio = st.ratio > 0 ? format(" (%.2f x)", st.ratio) : "";
  out.push_back(who +
                (st.cause == Part::DataWait
                     ? format(" waits %.2f ms a step longer for its input than the median of the other ranks", st.extra_ms)
                     : format(" computes %.2f ms a step longer than the median of the other ranks", st.extra_ms)) +
                ratio + ", " + st.evidence +
                (st.estimated ? "; estimated from straggler_ratio and rank 0's compute (the metrics predate "
                                "straggler_extra_ms)"
                              : ""));
  const std::string not_tuning =
      "bucket or overlap tuning (parallel.bucket_mb, parallel.overlap_grad_reduce) will not recover it";
  if (st.rank == 0)
    out.push_back("the other ranks wait for it (not in rank 0's metrics; a trace, metrics.trace, shows each rank's "
                  "parts): " + not_tuning);
  else {
    const std::string waits = std::string("rank 0's wait for it shows as ") + part_name(st.waits_in) +
                              format(", %.2f ms a step: ", st.wait_ms) + not_tuning;
    if (st.waits_in == Part::PpBubble)
      out.push_back(waits + ", nor will more microbatches or an interleaved schedule: the pipeline moves at its "
                            "slowest stage's pace");
    else if (st.waits_in == Part::DpExposed)
      out.push_back(waits + ", since the last bucket waits for " + who + "'s gradients however early the first starts");
    else
      out.push_back(waits + ", since it waits for " + who + "'s work");
  }
  if (st.cause == Part::DataWait)
    out.push_back("find why its input is slower: its storage or its host's load; data.loader_threads and "
                  "data.prefetch_max help only where its loader, not its storage, is the limit");
  else
    out.push_back("find what slows " + who + ": other processes on its host or device (its cpu_wait_ms), a slower or "
                  "throttled device; or, for a pipeline stage with more work than the others, rebalance the stages");
  if (cfg && cfg->faults.kind == FaultKind::SlowRank && cfg->faults.rank == st.rank)
    out.push_back(format("the run's config injects it: faults.kind=slow_rank, faults.rank=%.0f, faults.delay_ms=%g",
                      double(st.rank), cfg->faults.delay_ms));
  // Where the straggler explains less than half of the wait, the rest is
  // worth the part's own advice. (Not for less: on a loaded machine the wait
  // also holds the straggler's other delays, which no tuning recovers either.)
  const double rest = st.wait_ms - st.extra_ms;
  if (st.rank != 0 && rest >= std::max(st.extra_ms, kSignificant * s.step_ms)) {
    out.push_back(std::string("beyond the straggler, ") + part_name(st.waits_in) +
                  format(" still takes %.2f ms a step:", rest));
    part_advice(st.waits_in, s, cfg, out);
  }
}

}  // namespace

Advice advise(const Summary& s, const Config* cfg, const std::optional<Straggler>& straggler) {
  Advice a;
  double best = -1;
  for (int p = 1; p < kParts; ++p)
    if (s.share[p] > best) best = s.share[p], a.bottleneck = Part(p);
  a.significant = best >= kSignificant;
  if (straggler) {
    a.straggler = straggler;
    straggler_advice(s, cfg, *straggler, a.lines);
    return a;
  }
  if (!a.significant) {
    a.lines.push_back(format("no part besides compute takes %.0f%% of the step (the largest, ", 100 * kSignificant) +
                      part_name(a.bottleneck) + format(", takes %.1f%%): the run is compute-bound", 100 * best));
    return a;
  }
  part_advice(a.bottleneck, s, cfg, a.lines);
  return a;
}

bool Comparison::any_regression() const {
  if (tps_regression) return true;
  for (const PartDelta& d : parts)
    if (d.regression) return true;
  return false;
}

Comparison compare(const Summary& run, const Summary& base, double tolerance) {
  Comparison c;
  c.tolerance = tolerance;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto pct = [&](double now, double then) { return then > 0 ? 100 * (now - then) / then : nan; };
  c.base_tps = base.tps_median, c.run_tps = run.tps_median;
  c.tps_delta_pct = pct(c.run_tps, c.base_tps);
  c.tps_regression = c.run_tps < (1 - tolerance) * c.base_tps;
  c.base_step_ms = base.step_ms, c.run_step_ms = run.step_ms;
  c.step_delta_pct = pct(c.run_step_ms, c.base_step_ms);
  for (int p = 0; p < kParts; ++p) {
    PartDelta d{Part(p), base.ms[p], run.ms[p], run.ms[p] - base.ms[p], pct(run.ms[p], base.ms[p]), false};
    d.regression = d.delta_ms > tolerance * base.step_ms;
    c.parts.push_back(d);
  }
  return c;
}

}  // namespace xirang::analysis::report
