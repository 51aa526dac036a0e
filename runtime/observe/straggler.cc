#include "runtime/observe/straggler.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"

namespace xirang {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t h = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + h, v.end());
  if (v.size() % 2) return v[h];
  return 0.5 * (v[h] + *std::max_element(v.begin(), v.begin() + h));
}

}  // namespace

StragglerFinding find_straggler(const std::vector<double>& ms_per_rank) {
  StragglerFinding f;
  if (ms_per_rank.empty()) return f;
  f.rank = int(std::max_element(ms_per_rank.begin(), ms_per_rank.end()) - ms_per_rank.begin());
  f.ms = ms_per_rank[size_t(f.rank)];
  if (ms_per_rank.size() == 1) {
    f.ratio = 1;
    return f;
  }
  // The median of the others: with two ranks a slow one is compared with
  // the other, not with their mean (which would cap the ratio below 2).
  std::vector<double> others = ms_per_rank;
  others.erase(others.begin() + f.rank);
  const double med = median(others);
  f.ratio = med > 0 ? f.ms / med : 0;
  f.extra_ms = f.ms - med;
  return f;
}

StragglerDetector::StragglerDetector(const MetricsConfig& metrics, ProcessGrid& grid)
    : every_(metrics.straggler_every), checks_(metrics.straggler_checks), ratio_(metrics.straggler_ratio),
      grid_(grid) {}

void StragglerDetector::on_step(StepMetrics& m) {
  compute_ms_.push_back(m.forward_ms + m.backward_ms);
  step_ms_.push_back(m.step_ms);
  // Every rank reaches the same step numbers, so every rank joins the same checks.
  if (every_ > 0 && m.step % every_ == 0) check(m.step);
  m.slowest_rank = last_.rank;
  m.straggler_ratio = last_.ratio;
  m.straggler_extra_ms = last_.extra_ms;
}

void StragglerDetector::check(int step) {
  Communicator& world = grid_.world();
  const int n = world.size();
  double mine[2] = {median(compute_ms_), median(step_ms_)};
  std::vector<double> all(size_t(2 * n));
  world.all_gather(Tensor(mine, {2}, DType::F64), Tensor(all.data(), {2 * n}, DType::F64));
  compute_ms_.clear();
  step_ms_.clear();
  std::vector<double> compute(all.size() / 2);
  for (int r = 0; r < n; ++r) compute[size_t(r)] = all[size_t(2 * r)];
  last_ = find_straggler(compute);
  if (last_.ratio > ratio_) {
    run_ = last_.rank == run_rank_ ? run_ + 1 : 1;
    run_rank_ = last_.rank;
  } else {
    run_ = 0;
    run_rank_ = -1;
  }
  // Once per episode: when the run of checks reaches the configured length.
  if (run_ != checks_ || grid_.world_rank() != 0) return;
  const GridCoords c = grid_coords(grid_.shape(), last_.rank);
  std::fprintf(stderr,
               "straggler: rank %d (dp %d, %stp %d, pp %d) compute %.1f ms is %.2f x the median for %d checks "
               "(step %d; its step time %.1f ms)\n",
               last_.rank, c.dp, grid_.shape().cp > 1 ? str_cat("cp ", c.cp, ", ").c_str() : "", c.tp, c.pp, last_.ms,
               last_.ratio, run_, step, all[size_t(2 * last_.rank + 1)]);
  std::fflush(stderr);
}

}  // namespace xirang
