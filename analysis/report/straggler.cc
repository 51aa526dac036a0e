// The straggler behind a waiting part: which rank the others wait for, and
// by how much, from metrics.jsonl's straggler checks or a trace's per-rank
// parts. Rank 0's metrics show a slow rank only as its own wait (exposed dp
// communication, a pipeline bubble), whose usual advice cannot help.
#include <algorithm>
#include <cstdio>
#include <map>
#include <tuple>

#include "analysis/report/report.h"
#include "analysis/report/trace.h"

namespace xirang::analysis::report {

namespace {

// The parts in which one rank waits for another.
constexpr Part kWaitParts[] = {Part::DpExposed, Part::PpBubble, Part::PpExposed, Part::TpComm, Part::CpComm};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// The largest waiting part of `ms`, and the sum of them all.
std::pair<Part, double> waits(const std::array<double, kParts>& ms) {
  Part largest = kWaitParts[0];
  double sum = 0;
  for (Part p : kWaitParts) {
    sum += ms[size_t(p)];
    if (ms[size_t(p)] > ms[size_t(largest)]) largest = p;
  }
  return {largest, sum};
}

// From the checks in the summarised steps. A row keeps the last check's
// values until the next check, so a check is a row whose values differ
// from the row before it. Without straggler_extra_ms (older metrics) the
// extra time is estimated from the ratio and rank 0's compute, rank 0
// standing for the median rank.
struct ChecksResult {
  int checks = 0;  // in the summarised steps; 0: the metrics have none
  std::optional<Straggler> found;
};
ChecksResult from_checks(const Run& run, const Summary& s, double threshold) {
  ChecksResult out;
  const size_t first = s.warmup_skipped ? 1 : 0;
  std::map<int, std::vector<std::pair<double, double>>> above;  // rank -> (ratio, extra ms) of its checks above
  std::map<int, bool> estimated;
  for (size_t i = first; i < run.steps.size(); ++i) {
    const StepRow& r = run.steps[i];
    if (r.slowest_rank < 0 || r.straggler_ratio <= 0) continue;
    if (i > 0) {
      const StepRow& prev = run.steps[i - 1];
      if (std::tie(prev.slowest_rank, prev.straggler_ratio, prev.straggler_extra_ms) ==
          std::tie(r.slowest_rank, r.straggler_ratio, r.straggler_extra_ms))
        continue;
    }
    ++out.checks;
    if (r.straggler_ratio <= threshold) continue;
    const double compute = r.ms[size_t(Part::Compute)];
    double extra = 0;
    if (r.straggler_extra_ms) extra = *r.straggler_extra_ms;
    else {
      extra = r.slowest_rank == 0 ? compute * (1 - 1 / r.straggler_ratio) : compute * (r.straggler_ratio - 1);
      estimated[r.slowest_rank] = true;
    }
    above[r.slowest_rank].push_back({r.straggler_ratio, extra});
  }
  int rank = -1;
  size_t votes = 0;
  for (const auto& [r, v] : above)
    if (v.size() > votes) rank = r, votes = v.size();
  if (votes < 2 || 2 * int(votes) <= out.checks) return out;
  std::vector<double> ratios, extras;
  for (const auto& [ratio, extra] : above[rank]) ratios.push_back(ratio), extras.push_back(extra);
  Straggler st;
  st.rank = rank;
  st.cause = Part::Compute;
  st.ratio = median(ratios);
  st.extra_ms = median(extras);
  st.estimated = estimated[rank];
  st.evidence = "named by " + std::to_string(votes) + " of " + std::to_string(out.checks) +
                " straggler checks (metrics.straggler_every)";
  out.found = st;
  return out;
}

// The rank whose part `p` in a trace is longest, against the other ranks'
// median, when above the ratio (or the others have none of it) and its
// extra time is significant: the others must wait for it, so their median
// waiting time is at least half of the extra.
std::optional<Straggler> from_trace(const Utilisation& u, Part p, double threshold, double step_ms) {
  if (u.ranks.size() < 2) return std::nullopt;
  size_t slow = 0;
  for (size_t i = 1; i < u.ranks.size(); ++i)
    if (u.ranks[i].ms[size_t(p)] > u.ranks[slow].ms[size_t(p)]) slow = i;
  std::vector<double> others, others_wait;
  for (size_t i = 0; i < u.ranks.size(); ++i)
    if (i != slow) {
      others.push_back(u.ranks[i].ms[size_t(p)]);
      others_wait.push_back(waits(u.ranks[i].ms).second);
    }
  const double mine = u.ranks[slow].ms[size_t(p)], med = median(others);
  Straggler st;
  st.rank = u.ranks[slow].rank;
  st.cause = p;
  st.extra_ms = mine - med;
  st.ratio = med > 0 ? mine / med : 0;
  if ((med > 0 && st.ratio <= threshold) || st.extra_ms < kSignificant * step_ms ||
      median(others_wait) < 0.5 * st.extra_ms)
    return std::nullopt;
  st.evidence = "over traced steps " + std::to_string(u.first_step) + "-" + std::to_string(u.last_step) + " (trace: " +
                u.source + ")";
  return st;
}

}  // namespace

std::optional<Straggler> find_straggler(const Run& run, const Summary& s, const Utilisation* u) {
  const double threshold = run.config ? run.config->metrics.straggler_ratio : MetricsConfig{}.straggler_ratio;
  const ChecksResult checks = from_checks(run, s, threshold);
  std::vector<Straggler> found;
  if (checks.found && checks.found->extra_ms >= kSignificant * s.step_ms) found.push_back(*checks.found);
  if (u) {
    // The checks cover more steps than a trace: the trace's compute only where there are none.
    if (checks.checks == 0)
      if (auto t = from_trace(*u, Part::Compute, threshold, s.step_ms)) found.push_back(*t);
    if (auto t = from_trace(*u, Part::DataWait, threshold, s.step_ms)) found.push_back(*t);
  }
  if (found.empty()) return std::nullopt;
  Straggler st = *std::max_element(found.begin(), found.end(),
                                   [](const Straggler& a, const Straggler& b) { return a.extra_ms < b.extra_ms; });
  if (st.rank != 0) {
    // Rank 0 is one of the ranks that wait: its metrics must show the wait.
    const auto [largest, total] = waits(s.ms);
    if (total < 0.5 * st.extra_ms) return std::nullopt;
    st.waits_in = largest;
    st.wait_ms = s.ms[size_t(largest)];
  }
  return st;
}

}  // namespace xirang::analysis::report
