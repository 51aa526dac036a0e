// What the rows say together: scaling series and their efficiency, the
// measured pipeline bubble beside the simulator's and the analytic one, and
// the text tables of all three.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <set>

#include "core/error.h"
#include "analysis/format.h"
#include "runtime/step/schedule.h"
#include "runtime/observe/step_fields.h"
#include "analysis/sweep/sweep.h"

namespace xirang::analysis::sweep {

namespace {

double num(const Json& row, const char* a, const char* b = nullptr) {
  const Json& j = b ? row[a][b] : row[a];
  return j.is_number() ? j.get<double>() : 0.0;
}

bool ok(const Json& row) { return row["status"] == "ok"; }

// The settings a series holds fixed: everything but ranks, dp and the global batch.
std::string series_key(const Json& row) {
  Json k = row["layout"];
  k.erase("dp");
  k.erase("global_batch");
  Json s = row["settings"];
  for (const char* drop : {"ranks", "parallel.dp", "train.global_batch"}) s.erase(drop);
  return k.dump() + s.dump() + row["model"].dump() + row["precision"].dump();
}

// What the fixed settings of a series are, for its label.
std::string series_label(const Json& row) {
  std::string l;
  for (const auto& [k, v] : row["settings"].items())
    if (k != "ranks" && k != "parallel.dp" && k != "train.global_batch")
      l += str_cat(" ", k.substr(k.rfind('.') + 1), "=", v.is_string() ? v.get<std::string>() : v.dump());
  const Json& lay = row["layout"];
  if (lay["tp"] != 1 || lay["pp"] != 1) l += str_cat(" tp", lay["tp"].dump(), " pp", lay["pp"].dump());
  if (lay.value("cp", 1) != 1) l += str_cat(" cp", lay["cp"].dump());  // rows written before cp have none
  return l;
}

void add_series(std::vector<ScalingSeries>& out, std::vector<const Json*> rows, bool weak, const std::string& label) {
  std::sort(rows.begin(), rows.end(), [](const Json* a, const Json* b) { return num(*a, "ranks") < num(*b, "ranks"); });
  std::set<int> ranks;
  for (const Json* r : rows) ranks.insert(int(num(*r, "ranks")));
  if (ranks.size() < 2 || ranks.size() != rows.size()) return;
  ScalingSeries s;
  s.weak = weak;
  s.label = label;
  const double base = num(*rows[0], "tokens_per_s") / num(*rows[0], "ranks");
  for (const Json* r : rows) {
    const double per_rank = num(*r, "tokens_per_s") / num(*r, "ranks");
    s.points.push_back({int(num(*r, "ranks")), num(*r, "tokens_per_s"), base > 0 ? per_rank / base : 0.0,
                        r->at("id").get<std::string>()});
  }
  out.push_back(std::move(s));
}

}  // namespace

std::vector<ScalingSeries> scaling_series(const std::vector<Json>& rows) {
  std::map<std::string, std::vector<const Json*>> groups;
  for (const Json& r : rows)
    if (ok(r)) groups[series_key(r)].push_back(&r);
  std::vector<ScalingSeries> out;
  for (const auto& [key, members] : groups) {
    // Strong: the same global batch over more ranks. Weak: the same global batch per rank.
    std::map<double, std::vector<const Json*>> strong, weak;
    for (const Json* r : members) {
      const double gb = num(*r, "layout", "global_batch");
      strong[gb].push_back(r);
      weak[gb / num(*r, "ranks")].push_back(r);
    }
    const std::string label = series_label(*members[0]);
    for (const auto& [gb, s] : strong) add_series(out, s, false, str_cat("strong, global_batch ", gb, label));
    for (const auto& [per, s] : weak) add_series(out, s, true, str_cat("weak, ", per, " sequences per rank", label));
  }
  return out;
}

double simulated_bubble(const std::string& schedule, int p, int m, int v, double backward_over_forward) {
  try {
    SimCosts costs;
    costs.forward = 1;
    costs.backward = backward_over_forward > 0 ? backward_over_forward : 2;
    const SimResult r = simulate(parse_schedule(schedule, "parallel.schedule"), p, m, v, costs);
    return r.ok ? r.bubble_fraction : -1;
  } catch (const Error&) {
    return -1;  // a layout the schedule does not support (interleaved: m % p != 0)
  }
}

std::vector<BubbleRow> bubble_rows(const std::vector<Json>& rows) {
  std::vector<BubbleRow> out;
  for (const Json& r : rows) {
    if (!ok(r) || num(r, "layout", "pp") < 2) continue;
    const Json& lay = r["layout"];
    BubbleRow b;
    b.id = r["id"].get<std::string>();
    b.pp = lay["pp"].get<int>();
    b.v = lay["virtual_stages"].get<int>();
    b.schedule = lay["schedule"].get<std::string>();
    b.m = lay["global_batch"].get<int>() / (lay["micro_batch"].get<int>() * lay["dp"].get<int>());
    // The pipeline's part of the step: the passes, their communication and the waits (rank 0).
    auto part = [&](StepPart p) { return num(r, "breakdown_ms", step_field(p).key); };
    double span = 0;
    for (StepPart p : {StepPart::Forward, StepPart::Backward, StepPart::TpComm, StepPart::CpComm, StepPart::PpBubble,
                       StepPart::PpCommExposed, StepPart::DataWait})
      span += part(p);
    b.measured = span > 0 ? part(StepPart::PpBubble) / span : 0;
    const double f = part(StepPart::Forward);
    b.backward_over_forward = f > 0 ? part(StepPart::Backward) / f : 2;
    b.simulated = simulated_bubble(b.schedule, b.pp, b.m, b.v, b.backward_over_forward);
    b.analytic = analytic_bubble(parse_schedule(b.schedule, "parallel.schedule"), b.pp, b.m, b.v);
    out.push_back(b);
  }
  return out;
}

namespace {

// The id column's width: the longest id.
int id_width(const std::vector<Json>& rows) {
  size_t w = 10;
  for (const Json& r : rows) w = std::max(w, r["id"].get<std::string>().size());
  return int(w);
}

std::string points_table(const std::vector<Json>& rows) {
  const int w = id_width(rows);
  std::string t = format("%-4s %-*s %5s %-8s %10s %10s %10s %12s %7s %10s\n", "pt", w, "id", "ranks", "status", "step_ms",
                      "p10", "p90", "tokens/s", "MFU %", "mem/rank");
  for (const Json& r : rows) {
    const double mem = num(r, "memory_bytes_per_rank") / (1 << 20);
    std::string mem_text = r["memory_bytes_per_rank"].is_number() ? format("%.2f MiB", mem) : "-";
    if (!ok(r)) {
      t += format("%-4d %-*s %5d %-8s %10s %10s %10s %12s %7s %10s\n", r["point"].get<int>(), w, r["id"].get<std::string>().c_str(),
               r["ranks"].get<int>(), r["status"].get<std::string>().c_str(), "-", "-", "-", "-", "-", mem_text.c_str());
      t += "       " + r["reason"].get<std::string>() + "\n";
      continue;
    }
    t += format("%-4d %-*s %5d %-8s %10.2f %10.2f %10.2f %12.0f %7.3f %10s\n", r["point"].get<int>(), w,
             r["id"].get<std::string>().c_str(), r["ranks"].get<int>(), "ok", num(r, "step_ms_median"),
             num(r, "step_ms_p10"), num(r, "step_ms_p90"), num(r, "tokens_per_s"), 100 * num(r, "mfu"), mem_text.c_str());
  }
  return t;
}

std::string shares_table(const std::vector<Json>& rows) {
  const int w = id_width(rows);
  std::string t = format("%-*s", w, "id");
  for (const std::string& k : breakdown_keys()) t += format(" %8.8s", k.substr(0, k.size() - 3).c_str());
  t += "\n";
  for (const Json& r : rows) {
    if (!ok(r)) continue;
    t += format("%-*s", w, r["id"].get<std::string>().c_str());
    for (const std::string& k : breakdown_keys()) t += format(" %7.1f%%", 100 * num(r, "shares", k.substr(0, k.size() - 3).c_str()));
    t += "\n";
  }
  return t;
}

}  // namespace

std::string summary_tables(const std::vector<Json>& rows) {
  std::string t = "points (medians over the measured steps)\n" + points_table(rows);
  t += "\nstep time shares of the median step (dp_comm overlaps backward; the others are disjoint parts)\n" +
       shares_table(rows);
  const std::vector<ScalingSeries> series = scaling_series(rows);
  if (!series.empty()) t += "\nscaling efficiency: (tokens/s per rank) / (that of the series' fewest ranks)\n";
  for (const ScalingSeries& s : series) {
    t += s.label + "\n";
    for (const ScalingPoint& p : s.points)
      t += format("  %5d ranks %12.0f tokens/s  efficiency %6.1f%%  (%s)\n", p.ranks, p.tokens_per_s, 100 * p.efficiency,
               p.id.c_str());
  }
  const std::vector<BubbleRow> bubbles = bubble_rows(rows);
  const int w = id_width(rows);
  if (!bubbles.empty())
    t += "\npipeline bubble: measured pp_bubble / (fwd + bwd + tp + bubble + pp sends + data wait) on rank 0,\n"
         "simulated by runtime/schedule with the measured backward/forward ratio, analytic (p-1)/(v m + p - 1)\n" +
         format("%-*s %3s %-12s %2s %4s %9s %9s %9s %7s\n", w, "id", "pp", "schedule", "v", "m", "measured", "simulated",
             "analytic", "bwd/fwd");
  for (const BubbleRow& b : bubbles)
    t += format("%-*s %3d %-12s %2d %4d %8.1f%% %8.1f%% %8.1f%% %7.2f\n", w, b.id.c_str(), b.pp, b.schedule.c_str(), b.v, b.m,
             100 * b.measured, 100 * b.simulated, 100 * b.analytic, b.backward_over_forward);
  return t;
}

}  // namespace xirang::analysis::sweep
