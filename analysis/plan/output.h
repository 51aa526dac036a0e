// analysis/plan/output.h: how `xirang plan` prints predictions: a ranked
// table, every term (--explain), or JSON for scripts (--json).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "analysis/plan/cost_model.h"

namespace xirang::analysis::plan {

// One line per layout: rank, layout, memory, step time, tokens/s, TFLOP/s, MFU, largest terms.
std::string table(const std::vector<Prediction>& ps, const Cluster& c);
// Every time term with how it was computed, and memory by category.
std::string explain(const Prediction& p, const Workload& w, const Cluster& c);
nlohmann::json to_json(const Prediction& p);

}  // namespace xirang::analysis::plan
