#include "analysis/plan/search.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <queue>

namespace xirang::analysis::plan {

namespace {

std::vector<int> divisors(int n, int cap) {
  std::vector<int> d;
  for (int i = 1; i <= n && i <= cap; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// Every layout of the devices that the rules allow, before memory.
std::vector<PlanLayout> candidates(const Workload& w, const Cluster& c, const SearchOptions& o) {
  std::vector<PlanLayout> out;
  const int n = o.devices, gb = w.cfg.train.global_batch, layers = w.cfg.model.n_layer;
  for (int tp : divisors(std::min(n, c.devices_per_node), c.devices_per_node)) {
    if (n % tp) continue;
    for (int pp : divisors(n / tp, layers))
      for (int cp : divisors(n / (tp * pp), o.max_context_parallel)) {
        const int dp = n / (tp * pp * cp);
        if (gb % dp) continue;
        // cp's own rules (2 cp chunks per sequence, rows over tp) are layout_problem's, from the config's validation.
        for (int mb : divisors(gb / dp, o.max_micro_batch))
          for (int v : divisors(layers / pp, pp > 1 ? o.max_virtual_stages : 1))
            for (int zero = 0; zero <= (dp * cp > 1 ? 1 : 0); ++zero)
              for (int sp = 0; sp <= (tp > 1 ? 1 : 0); ++sp)
                for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
                  PlanLayout l{dp, tp, pp, v, mb, zero, sp == 1, rc, cp};
                  if (layout_problem(w, l, c).empty()) out.push_back(l);
                }
      }
  }
  return out;
}

}  // namespace

// The ranking is that of predicting every candidate and checking memory from
// the fastest down, without simulating most of them: candidates go in order
// of a lower bound on their step (step_lower_bound: all but the simulated
// pipeline terms), and a predicted layout is taken once no candidate left
// can be faster (its step below the next bound). Ties keep enumeration order.
SearchResult search(const Workload& w, const Cluster& c, const SearchOptions& o) {
  SearchResult r;
  const std::vector<PlanLayout> all = candidates(w, c, o);
  r.candidates = int(all.size());
  std::vector<std::pair<double, size_t>> bounds;  // (bound on the step, enumeration index)
  for (size_t i = 0; i < all.size(); ++i)
    bounds.push_back({o.prune ? step_lower_bound(w, all[i], c, o.features) : 0.0, i});
  std::sort(bounds.begin(), bounds.end());
  // Predicted, not yet taken: the fastest (then the first enumerated) on top.
  auto slower = [](const std::pair<Prediction, size_t>& a, const std::pair<Prediction, size_t>& b) {
    return a.first.time.step_s != b.first.time.step_s ? a.first.time.step_s > b.first.time.step_s : a.second > b.second;
  };
  std::priority_queue<std::pair<Prediction, size_t>, std::vector<std::pair<Prediction, size_t>>, decltype(slower)> ready(slower);
  size_t next = 0;
  while (int(r.ranked.size()) < o.top) {
    const bool more = next < bounds.size();
    if (more && (ready.empty() || ready.top().first.time.step_s >= bounds[next].first)) {
      const size_t i = bounds[next++].second;
      ready.push({predict_time(w, all[i], c, o.features), i});
      continue;
    }
    if (ready.empty()) break;
    Prediction p = ready.top().first;
    ready.pop();
    add_memory(w, c, p);
    if (p.fits) r.ranked.push_back(p);
    else ++r.rejected_memory;
  }
  return r;
}

std::string compare(const Prediction& a, const Prediction& b) {
  const StepTime &x = a.time, &y = b.time;
  const std::pair<const char*, double> d[] = {
      {"compute", (x.forward_s + x.backward_s) - (y.forward_s + y.backward_s)},
      {"recomputation", x.recompute_s - y.recompute_s},
      {"tp comm", x.tp_comm_s - y.tp_comm_s},
      {"cp comm", x.cp_comm_s - y.cp_comm_s},
      {"pipeline bubble", x.pp_bubble_s - y.pp_bubble_s},
      {"pp transfers", x.pp_comm_exposed_s - y.pp_comm_exposed_s},
      {"exposed dp comm", x.dp_comm_exposed_s - y.dp_comm_exposed_s},
      {"optimizer", x.optimizer_s - y.optimizer_s},
  };
  std::vector<std::pair<const char*, double>> v(std::begin(d), std::end(d));
  std::sort(v.begin(), v.end(), [](auto& p, auto& q) { return std::fabs(p.second) > std::fabs(q.second); });
  std::string s;
  char buf[160];
  std::snprintf(buf, sizeof buf, "%+.1f%% tokens/s; step %+.4g s:", 100 * (a.tokens_per_s / b.tokens_per_s - 1),
                x.step_s - y.step_s);
  s = buf;
  for (size_t i = 0; i < v.size() && i < 3; ++i) {
    if (std::fabs(v[i].second) < 1e-4 * y.step_s) break;
    std::snprintf(buf, sizeof buf, " %s %+.4g s (%+.1f%% of the step)%s", v[i].first, v[i].second,
                  100 * v[i].second / y.step_s, i + 1 < v.size() && i < 2 ? ";" : "");
    s += buf;
  }
  return s;
}

}  // namespace xirang::analysis::plan
