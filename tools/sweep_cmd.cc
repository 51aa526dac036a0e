// xirang sweep SPEC.yaml [--out DIR] [--resume] [--dry-run] [--launcher mpirun|srun|TEMPLATE]
//
// Runs every point of a sweep spec as its own `xirang train` job and writes
// one row per point to DIR/results.jsonl and DIR/results.csv, then text
// tables and plots. The work lives in analysis/sweep/; this file parses the
// arguments, walks the points and prints the progress.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "tools/commands.h"
#include "analysis/sweep/sweep.h"

namespace xirang::tools {

namespace {

using namespace sweep;
namespace fs = std::filesystem;

const char* kSweepUsage =
    "usage: xirang sweep SPEC.yaml [--out DIR] [--resume] [--dry-run] [--launcher mpirun|srun|TEMPLATE]\n"
    "  SPEC.yaml        base config, set, axes or points, steps, warmup, repeats, timeout_s, launcher\n"
    "                   (docs/scaling.md; examples in configs/sweeps/)\n"
    "  --out DIR        where results.jsonl, results.csv, summary.txt, plots/ and points/<id>/ go\n"
    "                   (default runs/sweeps/<spec name>)\n"
    "  --resume         continue the sweep in DIR: points with a row in results.jsonl are not run again\n"
    "  --dry-run        print each point's validation and launch command; run nothing, write nothing\n"
    "  --launcher L     replace the spec's launcher and its launcher_args: mpirun, srun (srun --mpi=pmix),\n"
    "                   or a command template with {args} and {ranks} {xirang} {id} {dir}\n";

struct SweepArgs {
  std::string spec, out, launcher;
  bool resume = false, dry_run = false;
};

SweepArgs parse_args(int argc, char** argv) {
  SweepArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "sweep: ", s, " needs a value");
      return argv[++i];
    };
    if (s == "--out") a.out = value();
    else if (s == "--launcher") a.launcher = value();
    else if (s == "--resume") a.resume = true;
    else if (s == "--dry-run") a.dry_run = true;
    else if (!s.empty() && s[0] == '-') fail(ErrorKind::Usage, "sweep: unknown option '", s, "' (see xirang sweep --help)");
    else if (a.spec.empty()) a.spec = s;
    else fail(ErrorKind::Usage, "sweep: more than one spec given ('", a.spec, "' and '", s, "')");
  }
  if (a.spec.empty()) fail(ErrorKind::Usage, "sweep: no spec given (usage: xirang sweep SPEC.yaml [options])");
  if (a.resume && a.dry_run) fail(ErrorKind::Usage, "sweep: --resume and --dry-run exclude each other");
  return a;
}

std::string self_path() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("xirang") : p.string();
}

std::string clock_text(double s) {
  char b[32];
  const int t = int(s + 0.5);
  std::snprintf(b, sizeof b, "%d:%02d:%02d", t / 3600, t / 60 % 60, t % 60);
  return b;
}

// Repeat k (1-based) of a point that passed validation.
RunOutcome run_repeat(const Spec& spec, const Point& p, const Prepared& pre, int k, const std::string& xirang,
                      const std::string& out) {
  const std::string dir = out + "/points/" + p.id + (spec.repeats > 1 ? "/r" + std::to_string(k) : "");
  fs::create_directories(dir);
  fs::remove(dir + "/metrics.jsonl");  // the trainer appends to it
  // The config the run will read, with the sweep's own two keys: `xirang report` finds it there.
  std::vector<std::string> keys = p.overrides;
  keys.push_back("train.steps=" + std::to_string(spec.steps));
  keys.push_back("metrics.jsonl=" + dir + "/metrics.jsonl");
  std::ofstream(dir + "/config.yaml") << load_config(spec.base, keys).yaml;
  const std::string cmd = launch_command(spec, p, pre.ranks, xirang, dir);
  std::ofstream(dir + "/command.sh") << cmd << '\n';
  const LaunchResult r = run_command(cmd, dir + "/train.log", spec.timeout_s, spec.env, spec.priority);
  return read_run(r, dir + "/train.log", dir + "/metrics.jsonl", spec.warmup);
}

// A point this sweep runs: its validated config and the repeats so far. It
// is finished when it was refused, when a repeat did not end ok (that ends
// the point), or when every repeat ran.
struct Pending {
  const Point* point;
  Prepared pre;
  std::vector<RunOutcome> runs;
  bool finished(int repeats) const {
    return !pre.refused.empty() || (!runs.empty() && runs.back().status != "ok") || int(runs.size()) == repeats;
  }
  int runs_left(int repeats) const { return finished(repeats) ? 0 : repeats - int(runs.size()); }
};

// The order of the runs: (index into `pending`, repeat), each point's
// repeats in a row, or in rounds (every point's first, then every point's
// second, ...) under repeat_order: rounds.
std::vector<std::pair<size_t, int>> run_order(const Spec& spec, size_t n) {
  std::vector<std::pair<size_t, int>> order;
  if (spec.rounds)
    for (int k = 1; k <= spec.repeats; ++k)
      for (size_t i = 0; i < n; ++i) order.push_back({i, k});
  else
    for (size_t i = 0; i < n; ++i)
      for (int k = 1; k <= spec.repeats; ++k) order.push_back({i, k});
  return order;
}

// The point's host.cpu_wait_share when it is over kContendedShare, else -1.
double contention(const Json& row) {
  const Json& h = row.contains("host") ? row["host"] : Json();
  if (!h.is_object() || !h.contains("cpu_wait_share") || !h["cpu_wait_share"].is_number()) return -1;
  const double c = h["cpu_wait_share"].get<double>();
  return c > kContendedShare ? c : -1;
}

std::string row_text(const Json& row) {
  const std::string status = row["status"].get<std::string>();
  if (status != "ok") return status + ": " + row["reason"].get<std::string>();
  char b[240];
  std::snprintf(b, sizeof b, "ok, %.2f ms/step (p10 %.2f, p90 %.2f), %.0f tokens/s", row["step_ms_median"].get<double>(),
                row["step_ms_p10"].get<double>(), row["step_ms_p90"].get<double>(), row["tokens_per_s"].get<double>());
  std::string s = b;
  if (const double c = contention(row); c >= 0)
    s += str_cat(" [waited for a core ", int(100 * c + 0.5), "% of the step: contended]");
  return s;
}

// The sweep's first line: what runs where, and under which Slurm job when inside one.
void print_header(const Spec& spec, const std::string& out, bool dry) {
  const char* job = std::getenv("SLURM_JOB_ID");
  std::printf("sweep %s: %zu point(s) of %s, launcher %s%s; results %s %s\n", spec.path.c_str(), spec.points.size(),
              spec.base.c_str(), spec.launcher.text.c_str(),
              job ? str_cat(" inside Slurm job ", job).c_str() : "", dry ? "would go to" : "in", out.c_str());
}

int dry_run(const Spec& spec, const std::string& out) {
  print_header(spec, out, true);
  const std::string xirang = self_path();
  for (const Point& p : spec.points) {
    const Prepared pre = prepare(spec, p);
    std::printf("[%d/%zu] %s (ranks %d): %s\n", p.index, spec.points.size(), p.id.c_str(), pre.ranks,
                pre.refused.empty() ? launch_command(spec, p, pre.ranks, xirang, out + "/points/" + p.id).c_str()
                                    : ("refused: " + pre.refused).c_str());
  }
  return 0;
}

// The rows of this spec's points, in point order.
std::vector<Json> ordered(const Spec& spec, const std::map<std::string, Json>& rows) {
  std::vector<Json> out;
  for (const Point& p : spec.points)
    if (auto it = rows.find(p.id); it != rows.end()) out.push_back(it->second);
  return out;
}

void finish(const Spec& spec, const std::map<std::string, Json>& rows, const std::string& out) {
  const std::vector<Json> list = ordered(spec, rows);
  const std::string tables = summary_tables(list);
  std::printf("\n%s", tables.c_str());
  std::ofstream(out + "/summary.txt") << tables;
  const PlotResult plots = write_plots(list, out + "/plots");
  if (!plots.skipped.empty()) std::printf("\nplots skipped: %s\n", plots.skipped.c_str());
  for (const std::string& f : plots.files) std::printf("%s%s\n", &f == &plots.files[0] ? "\nplots: " : "       ", f.c_str());
  std::printf("results: %s/results.jsonl, %s/results.csv, %s/summary.txt\n", out.c_str(), out.c_str(), out.c_str());
}

int run_sweep(const SweepArgs& args) {
  Spec spec = load_spec(args.spec);
  // The launcher's arguments belong to it: --launcher replaces both.
  if (!args.launcher.empty()) spec.launcher = parse_launcher(args.launcher, "--launcher");
  const std::string out = args.out.empty() ? "runs/sweeps/" + fs::path(args.spec).stem().string() : args.out;
  if (args.dry_run) return dry_run(spec, out);
  const std::string results = out + "/results.jsonl";
  if (!args.resume && fs::exists(results) && fs::file_size(results) > 0)
    fail(ErrorKind::Usage, "sweep: ", results, " already exists (--resume continues that sweep; or choose another --out)");
  fs::create_directories(out);
  fs::copy_file(spec.path, out + "/spec.yaml", fs::copy_options::overwrite_existing);
  std::map<std::string, Json> rows = args.resume ? read_results(results) : std::map<std::string, Json>{};
  print_header(spec, out, false);
  if (spec.priority)
    if (const std::string why = priority_problem(*spec.priority); !why.empty()) std::printf("note: %s\n", why.c_str());
  const std::string xirang = self_path();
  const size_t total = spec.points.size();
  std::vector<Pending> pending;
  std::map<std::string, size_t> position;  // a point's 1-based place in the spec, for the progress lines
  for (const Point& p : spec.points) {
    position[p.id] = position.size() + 1;
    if (auto it = rows.find(p.id); it != rows.end())
      std::printf("[%zu/%zu] %s: recorded earlier (%s)\n", position[p.id], total, p.id.c_str(),
                  it->second["status"].get<std::string>().c_str());
    else
      pending.push_back({&p, prepare(spec, p), {}});
  }
  int runs_done = 0;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  auto eta = [&] {
    int left = 0;
    for (const Pending& q : pending) left += q.runs_left(spec.repeats);
    return runs_done > 0 ? elapsed() / runs_done * left : 0.0;
  };
  for (const auto& [i, k] : run_order(spec, pending.size())) {
    Pending& q = pending[i];
    if (rows.count(q.point->id)) continue;  // its row is written
    if (!q.finished(spec.repeats)) {
      q.runs.push_back(run_repeat(spec, *q.point, q.pre, k, xirang, out));
      ++runs_done;
      if (spec.rounds && !q.finished(spec.repeats)) {  // in rounds, say each run; the row comes with the last
        const RunOutcome& r = q.runs.back();
        std::printf("[%zu/%zu] %s: repeat %d of %d done (median %.2f ms/step) | elapsed %s, ETA %s\n",
                    position[q.point->id], total, q.point->id.c_str(), k, spec.repeats, run_median_ms(r),
                    clock_text(elapsed()).c_str(), clock_text(eta()).c_str());
        std::fflush(stdout);
      }
    }
    if (!q.finished(spec.repeats)) continue;
    const Json row = make_row(*q.point, q.pre, q.runs);
    append_result(results, row);
    rows[q.point->id] = row;
    write_csv(ordered(spec, rows), out + "/results.csv");
    std::printf("[%zu/%zu] %s (ranks %d): %s | elapsed %s, ETA %s\n", position[q.point->id], total,
                q.point->id.c_str(), row["ranks"].get<int>(), row_text(row).c_str(), clock_text(elapsed()).c_str(),
                clock_text(eta()).c_str());
    std::fflush(stdout);
  }
  write_csv(ordered(spec, rows), out + "/results.csv");
  finish(spec, rows, out);
  int contended = 0;
  for (const auto& [id, row] : rows) contended += contention(row) >= 0;
  if (contended > 0)
    std::printf("note: %d point(s) waited for a core over %d%% of their step time (host.cpu_wait_share in "
                "results.jsonl): their step times include that waiting; compare or calibrate with points measured on "
                "free cores (a quiet machine, or the spec's priority as root)\n",
                contended, int(100 * kContendedShare));
  return 0;
}

}  // namespace

int sweep_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::fputs(kSweepUsage, stdout);
      return 0;
    }
  return run_sweep(parse_args(argc, argv));
}

}  // namespace xirang::tools
