// analysis/report/report.h: `xirang report`, a run's metrics.jsonl summarised:
// throughput, the step's time split into named components, the dominant
// bottleneck with advice computed from the run, a comparison with a baseline
// run, and plots through gnuplot.
//
//   Run run = load_run("runs/demo");                 // dir or metrics.jsonl
//   Summary s = summarise(run);                       // skips step 1 (warm-up)
//   std::optional<Straggler> st = find_straggler(run, s, nullptr);  // or a trace's Utilisation
//   Advice a = advise(s, run.config ? &*run.config : nullptr, st);
//   Comparison c = compare(s, summarise(load_run("runs/base")), 0.05);
#pragma once

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/timeline.h"
#include "runtime/config/config.h"
#include "analysis/gnuplot.h"

namespace xirang::analysis::report {

// The parts a step's time is split into. Unaccounted is step_ms minus the
// named ones: host work the trainer does not time (bookkeeping, logging).
enum class Part { Compute, Optimizer, DataWait, DpExposed, TpComm, CpComm, PpBubble, PpExposed, CkptStall, Unaccounted };
inline constexpr int kParts = 10;
// A part, or a straggler's extra time, under this share of the step is not worth a recommendation.
inline constexpr double kSignificant = 0.05;
const char* part_name(Part p);   // "data wait"
const char* part_key(Part p);    // "data_wait" (JSON, plots)

struct StepRow {
  int step = 0;
  double loss = 0, tokens_per_s = 0, step_ms = 0, mfu = 0;
  double dp_comm_ms = 0;            // all dp communication, hidden or not
  std::array<double, kParts> ms{};  // per Part; Unaccounted may be negative here
  std::optional<double> val_loss;
  // metrics.op_profile: op_ms and op_calls by OpKind (0 where the line has none).
  bool has_ops = false;
  std::array<double, kOpKindCount> op_ms{}, op_calls{};
  // The device's energy (CUDA runs with NVML readings); unset where the line has none.
  std::optional<double> joules_per_token, avg_watts;
  std::string energy_source;  // "nvml energy counter", "nvml power samples"
  std::string backend;        // "cpu", "cuda"; empty in files written before the field
  // metrics.straggler_every: the last check's slowest world rank (-1: no
  // check yet or none in the file), its compute over the other ranks'
  // median as a ratio and in ms (unset in files written before the field).
  int slowest_rank = -1;
  double straggler_ratio = 0;
  std::optional<double> straggler_extra_ms;
};

struct Run {
  std::string metrics_path;
  std::string config_path;        // empty: none found or given
  std::optional<Config> config;   // loaded (not validated) when config_path is set
  std::vector<StepRow> steps;
};

// Reads RUN (a metrics.jsonl file or a directory holding one). The config is
// `config_path` when given, else a config.yaml beside the metrics when there
// is one. Throws ErrorKind::Data on a missing file, a line that is not a JSON
// object, or a file without steps.
Run load_run(const std::string& path, const std::string& config_path = {},
             const std::vector<std::string>& overrides = {});

struct Summary {
  int steps = 0;            // in the file
  int used = 0;             // after skipping the warm-up
  bool warmup_skipped = false;
  double tps_median = 0, tps_p10 = 0, tps_p90 = 0;
  double mfu_median = 0;
  double step_ms = 0;                 // mean over the used steps
  std::array<double, kParts> ms{};    // mean per part; Unaccounted clamped at 0
  std::array<double, kParts> share{}; // of the shown total: sums to 1
  double unaccounted_raw_ms = 0;      // before clamping (negative: named parts overlap)
  double dp_comm_ms = 0;              // mean dp communication, hidden or not
};
Summary summarise(const Run& run);

struct Utilisation;  // analysis/report/trace.h

// One rank that holds the others back: its own work (compute, or its wait
// for input) is longer than the other ranks' median, and they spend the
// difference waiting for it (in dp comm, the pipeline bubble, tp or pp
// transfers), where no tuning of those parts recovers it. Found in the
// straggler checks metrics.jsonl carries (metrics.straggler_every; compute
// only), else in a trace's per-rank parts (compute and data wait).
struct Straggler {
  int rank = -1;               // world rank
  Part cause = Part::Compute;  // Compute (forward + backward) or DataWait (its input)
  double extra_ms = 0;         // a step, over the other ranks' median
  double ratio = 0;            // its time over that median (0: the median is 0)
  bool estimated = false;      // extra_ms from straggler_ratio x rank 0's compute (metrics before straggler_extra_ms)
  std::string evidence;        // "named by 2 of 2 straggler checks (metrics.straggler_every)", "traced steps 2-4"
  // Where rank 0 waits for it (when rank 0 is not the straggler): the
  // largest of its waiting parts, and that part's ms a step.
  Part waits_in = Part::Unaccounted;
  double wait_ms = 0;
};
// The straggler, if the run has one that matters: the same rank above the
// ratio (the run's metrics.straggler_ratio, else 1.3) in at least two
// checks and in more than half of the checks of the summarised steps, its
// extra time at least kSignificant of the step, and rank 0 (when it is not
// the straggler) waiting at least half of that time. Without checks in the
// metrics, `u` (a trace's utilisation, or null) gives the ranks' compute
// over the traced steps; data waits come from `u` only.
std::optional<Straggler> find_straggler(const Run& run, const Summary& s, const Utilisation* u);

struct Advice {
  Part bottleneck = Part::Unaccounted;
  bool significant = false;          // its share is worth acting on
  // Set: the bottleneck is this rank, the others' wait (in `bottleneck` on
  // rank 0) is its symptom, and the lines name it instead of tuning the part.
  std::optional<Straggler> straggler;
  std::vector<std::string> lines;    // concrete suggestions from the run and its config
};
Advice advise(const Summary& s, const Config* cfg, const std::optional<Straggler>& straggler = std::nullopt);

struct PartDelta {
  Part part;
  double base_ms = 0, run_ms = 0, delta_ms = 0, delta_pct = 0;
  bool regression = false;
};
struct Comparison {
  double tolerance = 0.05;
  double base_tps = 0, run_tps = 0, tps_delta_pct = 0;
  double base_step_ms = 0, run_step_ms = 0, step_delta_pct = 0;
  bool tps_regression = false;
  std::vector<PartDelta> parts;
  bool any_regression() const;
};
// A part regresses when it grew by more than `tolerance` of the baseline's
// step time (so a tiny part doubling is not flagged); tokens/s when its
// median fell by more than `tolerance`.
Comparison compare(const Summary& run, const Summary& base, double tolerance);

// Plots (analysis/report/plot.cc): PNGs through gnuplot. Returns the files
// written, or sets `skipped` to the reason nothing was plotted.
struct PlotResult {
  std::vector<std::string> files;
  std::string skipped;
};
PlotResult write_plots(const Run& run, const std::string& dir);
// Runs gnuplot on the script `make_script(TMP)` returns (it writes its data
// files under the private temp directory TMP) and lists `files` under
// `dir` as written; without gnuplot, or when it fails, says why instead.
PlotResult run_gnuplot(const std::string& dir, const std::function<std::string(const std::string&)>& make_script,
                       const std::vector<std::string>& files);

// Per-op profile (analysis/report/ops.cc), from runs with metrics.op_profile:
// per kind of op, the median over the profiled steps (warm-up skipped) of
// its time and calls per step. Compute kinds are the kernels' own time;
// communication kinds are in-flight time (submission to completion), which
// overlaps compute and each other, so their shares are not parts of the step.
struct OpRow {
  OpKind kind = OpKind::Matmul;
  double ms = 0;     // median ms per step
  double share = 0;  // ms / the median step_ms
  double calls = 0;  // median calls per step
};
struct OpProfile {
  int steps = 0;               // profiled steps summarised; 0: the run has no op_ms
  double step_ms = 0;          // their median step time
  std::vector<OpRow> compute;  // kinds with calls in any of them, in OpKind order
  std::vector<OpRow> comm;
  double compute_ms = 0, compute_share = 0;  // the compute rows' sum
};
OpProfile op_profile(const Run& run);

// Energy (analysis/report/energy.cc): the medians over the steps with readings
// (warm-up skipped as in summarise), or why the run has none.
struct EnergySummary {
  int steps = 0;  // steps summarised; 0: not measured
  double joules_per_token = 0, avg_watts = 0;  // medians
  std::string source;        // the metrics' energy_source
  std::string not_measured;  // why, when steps == 0
};
EnergySummary energy_summary(const Run& run);
// ops.png: a bar chart of the rows (median ms per step), compute and communication in two colours.
PlotResult write_op_plot(const OpProfile& ops, const std::string& dir);

}  // namespace xirang::analysis::report
