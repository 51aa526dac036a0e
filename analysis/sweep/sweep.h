// analysis/sweep/sweep.h: `xirang sweep`, a scaling benchmark over many
// configurations of one base config.
//
// A spec (YAML) names the base config, fixed overrides, and axes (a
// cartesian product) or an explicit list of points. Each point is validated
// in-process, launched as `xirang train` under a launcher (mpirun, srun or a
// command template) with its metrics.jsonl in DIR/points/<id>/, and
// summarised into one row of DIR/results.jsonl and DIR/results.csv.
//
//   Spec spec = load_spec("configs/sweeps/dp_strong.yaml");
//   for (const Point& p : spec.points) {
//     Prepared pre = prepare(spec, p);                   // validated config or the refusal
//     std::string cmd = launch_command(spec, p, xirang, "runs/s/points/" + p.id);
//   }
//   Table t = summary_tables(rows);  write_plots(rows, "runs/s");
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "runtime/config/config.h"

namespace xirang::analysis::sweep {

using Json = nlohmann::ordered_json;

// One setting of a point: a config key ("parallel.tp") or "ranks", with the
// value as the spec wrote it and as JSON (number, bool or string).
struct Setting {
  std::string key;
  std::string text;
  Json value;
};

struct Point {
  int index = 0;                    // 1-based, in expansion order
  std::string id;                   // stable: a function of the settings only
  std::vector<Setting> settings;    // the point's own (an axes combination or a points entry)
  std::vector<std::string> overrides;  // "key=value" for `xirang train --set`: the spec's set, then settings
  std::optional<int> ranks;         // when the point names it
};

enum class LauncherKind { Mpirun, Srun, Template };
struct Launcher {
  LauncherKind kind = LauncherKind::Mpirun;
  std::string text = "mpirun";      // the spec's spelling; the template itself for Template
  std::vector<std::string> args;    // launcher_args, after the rank count (mpirun, srun)
};

struct Spec {
  std::string path;                 // the spec file
  std::string base;                 // the base config, resolved against the spec's folder
  std::vector<Setting> set;         // fixed overrides of every point
  std::vector<Point> points;
  int steps = 10;                   // train.steps of every run
  int warmup = 1;                   // first steps left out of the statistics
  int repeats = 1;                  // runs per point, their measured steps pooled
  // repeat_order: rounds runs every point once, then every point again (a
  // slow minute of a shared machine then touches one run of several points,
  // which the pooled median outvotes, instead of every run of one point);
  // points (the default) runs each point's repeats in a row.
  bool rounds = false;
  double timeout_s = 600;           // per run; the process group is killed after it
  Launcher launcher;
  std::map<std::string, std::string> env;  // set in the launched command's environment
  // Nice value of each run (-20..19; negative needs root). A run is a
  // session of its own, and on Linux with autogroup scheduling a session's
  // processes share one CPU share whatever their own nice values, so the
  // value is given to the run's session (/proc/self/autogroup) as well:
  // that is what lets a measurement keep its cores against other sessions.
  std::optional<int> priority;
};

// Reads and expands a spec. Throws ErrorKind::Config with one line naming the
// spec file and the key on any malformed input.
Spec load_spec(const std::string& path);
// "mpirun", "srun", or a template holding {args} (and {ranks}, {xirang}, {id}, {dir}).
Launcher parse_launcher(const std::string& text, const std::string& where);

// A point's config, loaded and validated for its world size, or why not.
struct Prepared {
  int ranks = 0;
  std::optional<Config> config;     // loaded; validated when `refused` is empty
  std::string refused;              // the config error line
};
Prepared prepare(const Spec& spec, const Point& p);

// The shell command that runs one repeat of a point with its metrics in run_dir.
std::string launch_command(const Spec& spec, const Point& p, int ranks, const std::string& xirang,
                           const std::string& run_dir);
std::string shell_quote(const std::string& s);

struct LaunchResult {
  int exit_code = 0;      // the shell's status; 128 + signal when killed by one
  bool timed_out = false;
  double limit_s = 0;     // the time limit it ran under
  double wall_s = 0;
  // CPU time of the command and every process it waited for (getrusage of
  // children); negative where unknown.
  double cpu_s = -1;
};
// Runs `cmd` with /bin/sh in a session (and process group) of its own,
// stdout and stderr into log_path, `env` added, at `priority` when given;
// kills the group after timeout_s.
LaunchResult run_command(const std::string& cmd, const std::string& log_path, double timeout_s,
                         const std::map<std::string, std::string>& env, std::optional<int> priority = {});
// "" when `priority` can be applied here, else why not (one line).
std::string priority_problem(int priority);

// One run's outcome read back from its log and metrics.jsonl.
struct RunOutcome {
  std::string status;     // ok, oom, failed, timeout
  std::string reason;
  std::optional<double> memory_bytes;  // rank 0's memory plan total (memory_planned_bytes, else its printed plan)
  std::vector<Json> steps;             // measured metrics lines (warm-up left out)
  double wall_s = 0, cpu_s = -1;       // from the LaunchResult
};
RunOutcome read_run(const LaunchResult& r, const std::string& log_path, const std::string& metrics_path, int warmup);
// The median step_ms of one run's measured steps (0 when it has none).
double run_median_ms(const RunOutcome& r);

// The results.jsonl row of a point: settings, layout, status and, when every
// repeat was ok, the statistics over their pooled measured steps, and
// `host`: how much of the machine the runs had. host.cpu_wait_share is the
// median over measured steps of rank 0's cpu_wait_ms / step_ms (its main
// thread ready but waiting for a core: other work on the machine, or more
// threads than cores); step times of points above kContendedShare measure
// that waiting as well as the model's work. host.cpu_busy is the runs' CPU
// time over wall time x ranks.
constexpr double kContendedShare = 0.1;
Json make_row(const Point& p, const Prepared& pre, const std::vector<RunOutcome>& runs);

// The names of the breakdown fields, with "_ms" ("forward_ms", ...): the ten
// metrics.jsonl parts plus unaccounted_ms.
const std::vector<std::string>& breakdown_keys();

// results.jsonl: rows by id (the last row of an id wins), and the CSV of rows.
std::map<std::string, Json> read_results(const std::string& path);
void append_result(const std::string& path, const Json& row);
void write_csv(const std::vector<Json>& rows, const std::string& path);

// Scaling series among the ok rows: rows equal but for ranks (and dp) with the
// same global batch (strong) or the same global batch per rank (weak).
// Efficiency is tokens/s per rank over that of the series' fewest ranks.
struct ScalingPoint {
  int ranks = 0;
  double tokens_per_s = 0, efficiency = 0;
  std::string id;
};
struct ScalingSeries {
  std::string label;
  bool weak = false;
  std::vector<ScalingPoint> points;  // by ranks
};
std::vector<ScalingSeries> scaling_series(const std::vector<Json>& rows);

// The pipeline bubble of each ok row with pp > 1: measured on rank 0, the
// schedule simulator's with the measured backward/forward cost ratio, and
// the analytic (p-1)/(v m + p - 1).
struct BubbleRow {
  std::string id, schedule;
  int pp = 0, v = 1, m = 0;
  double measured = 0, simulated = 0, analytic = 0, backward_over_forward = 2;
};
std::vector<BubbleRow> bubble_rows(const std::vector<Json>& rows);
// The simulator's bubble fraction, or -1 where the schedule does not support m.
double simulated_bubble(const std::string& schedule, int p, int m, int v, double backward_over_forward);

// Text tables (points, scaling efficiency, pipeline bubble) and gnuplot plots.
std::string summary_tables(const std::vector<Json>& rows);
struct PlotResult {
  std::vector<std::string> files;
  std::string skipped;    // why nothing was plotted
};
PlotResult write_plots(const std::vector<Json>& rows, const std::string& dir);

}  // namespace xirang::analysis::sweep
