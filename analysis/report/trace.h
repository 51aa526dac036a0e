// analysis/report/trace.h: metrics.trace's timeline traces, read back.
//
// A traced run leaves one Chrome trace-event file per rank
// (DIR/rank_NNNNN.json, format "xirang-trace-1", runtime/observe/trace_writer.h).
// `xirang trace merge` checks them against one another and writes one file
// (format "xirang-trace-merged-1") with every rank's clock moved so that the
// barrier before the first traced step is t = 0; `xirang report` reads
// either to show where each rank's traced step time went.
//
//   Trace t = load_rank_traces("runs/x/trace");      // validated, t.ranks[r] is world rank r
//   write_json_atomic("runs/x/trace/trace.json", merge_traces(t));
//   Utilisation u = utilisation(load_trace("runs/x/trace"));  // a directory or a merged file
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "analysis/report/report.h"

namespace xirang::analysis::report {

struct RankTrace {
  std::string path;  // the file it came from
  int rank = 0, dp = 0, tp = 0, pp = 0;
  int cp = 0;                // its place in the cp group (files written before cp have none: 0)
  double clock_sync_us = 0;  // the rank's clock at the window's barrier (0 in a merged trace)
  nlohmann::json events;     // its traceEvents, as read
};

struct Trace {
  std::string source;  // the directory or merged file
  std::string job;
  int world_size = 0, first_step = 0, last_step = 0;
  std::vector<RankTrace> ranks;  // ranks[r].rank == r, for r in 0..world_size-1
};

// Reads every rank_*.json in `dir` and checks that they make one trace: the
// format, the same job, world size and steps, each rank of 0..world-1 once.
// Throws ErrorKind::Data with one line naming the file and what was expected.
Trace load_rank_traces(const std::string& dir);
// Reads a file written by `xirang trace merge`.
Trace load_merged_trace(const std::string& path);
// A directory with rank files, a directory holding only trace.json, or a merged file.
Trace load_trace(const std::string& path);

// The merged Chrome trace: every rank's events with its clock_sync_us
// subtracted from their timestamps, one process per rank named by its
// coordinates, otherData "xirang-trace-merged-1".
nlohmann::ordered_json merge_traces(const Trace& t);
// A rank's clock offset from rank 0's at the barrier, in microseconds.
double clock_offset_us(const Trace& t, int rank);
// Writes PATH.tmp and renames it over PATH.
void write_json_atomic(const std::string& path, const nlohmann::ordered_json& j);

// Where a rank's traced step time went: the self time of each span on its
// "compute" track inside the `step` spans (a span's time less the spans
// nested in it), summed per Part. Unaccounted is time in no named span
// (the step's own bookkeeping, the loss all-reduce).
struct RankUtilisation {
  int rank = 0, dp = 0, tp = 0, pp = 0;
  int cp = 0;  // the rank's place in its cp group (0 in traces written before cp, or at cp = 1)
  int steps = 0;
  double step_ms = 0;                  // mean traced step
  std::array<double, kParts> ms{};     // per step, mean
  std::array<double, kParts> share{};  // of the step time: sums to 1
};
struct Utilisation {
  std::string source;
  int first_step = 0, last_step = 0;
  std::vector<RankUtilisation> ranks;
};
Utilisation utilisation(const Trace& t);
// How the utilisation table and plot name ranks: "rank (dp,tp,pp)" and
// "3 (1,0,1)", with cp after dp ("rank (dp,cp,tp,pp)") when some rank's cp is not 0.
bool has_cp(const Utilisation& u);
std::string rank_axis(bool with_cp);
std::string rank_label(const RankUtilisation& r, bool with_cp);
// The part a compute-track span's self time counts as ("forward" -> Compute).
Part span_part(const std::string& name);

// The trace `xirang report` uses for a run: `given` when set, else
// RUN_DIR/trace when it holds rank files or trace.json; empty when none.
std::string find_run_trace(const Run& run, const std::string& given);

// utilisation.png in `dir`: one stacked bar of shares per rank.
PlotResult plot_utilisation(const Utilisation& u, const std::string& dir);

}  // namespace xirang::analysis::report
