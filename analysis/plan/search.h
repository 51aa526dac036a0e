// analysis/plan/search.h: every layout of N devices, ranked.
//
// Enumerates tp (dividing a node), pp, cp, dp = N / (tp pp cp), virtual stages,
// micro batch, ZeRO, sequence parallelism and recomputation; drops what the
// model or the batch cannot hold (layout_problem); predicts the time of
// every candidate, then checks memory from the fastest down until `top`
// layouts fit.
//
//   SearchResult r = search(workload, cluster, {.devices = 64, .top = 5});
//   r.ranked[0].layout.str();
#pragma once

#include <vector>

#include "analysis/plan/cost_model.h"

namespace xirang::analysis::plan {

struct SearchOptions {
  int devices = 1;
  int top = 10;
  Features features;
  int max_micro_batch = 16;
  int max_virtual_stages = 8;
  // Context parallelism pays off for long sequences; past 16 ranks per
  // sequence (Llama 3's largest) the candidates only slow the search down.
  int max_context_parallel = 16;
  // false: simulate every candidate (the ranking pruning must reproduce; tests compare the two).
  bool prune = true;
};

struct SearchResult {
  std::vector<Prediction> ranked;  // fitting layouts, fastest first (at most `top`)
  int candidates = 0;              // layouts the model allows
  int rejected_memory = 0;         // of those checked, how many did not fit
};

SearchResult search(const Workload& w, const Cluster& c, const SearchOptions& o);

// Why `a` is predicted faster or slower than `b`: the terms that differ most, in words.
std::string compare(const Prediction& a, const Prediction& b);

}  // namespace xirang::analysis::plan
