// Training throughput of GPT-2 124M on the CPU backend, as tokens/s and MFU
// against the sgemm rate measured in the same run (the limit a step built
// from matrix products can approach).
//
//   build/bin/train_bench [--steps N] [--shapes 4x64,8x256] [--set section.key=value ...] [--config llama_demo.yaml]
//   build/bin/train_bench --overhead trace|op_profile [--pairs 5] ...   // the feature on against off, as ratios
//   build/bin/train_bench --overhead recompute_selective|recompute_full ... // train.recompute=... against none
//
// --config names a file of configs/ (default gpt2_124m.yaml).
//
// The token stream is random (throughput does not depend on the text) and
// lives in a temporary dataset directory that is removed afterwards.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/error.h"
#include "core/omp_wait.h"
#include "kernels/cpu/gemm.h"
#include "kernels/matmul.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/trainer.h"

using namespace xirang;

namespace {

struct Shape2 {
  int batch, seq;
};

std::vector<Shape2> parse_shapes(const std::string& s) {
  std::vector<Shape2> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int b = 0, t = 0;
    if (std::sscanf(item.c_str(), "%dx%d", &b, &t) != 2 || b <= 0 || t <= 0) {
      std::fprintf(stderr, "train_bench: bad shape '%s' (expected BxT, e.g. 4x64)\n", item.c_str());
      std::exit(2);
    }
    out.push_back({b, t});
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

struct RunTime {
  double median_ms = 0;         // step time, the first step (one-time costs) left out
  double cpu_ms_per_step = 0;   // the process's CPU time (all threads) over the run, per step
  double flops_per_token = 0;
};

double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// Trains one configuration and times its steps.
std::string config_file = "gpt2_124m.yaml";  // --config

// The MFU's limit: the faster 1024^3 sgemm of the CPU GEMM paths this
// build has, each measured here (the path a run takes need not be the
// faster one on that product, and a limit from the slower would flatter).
// Leaves the run's own path set as it was.
double sgemm_peak(std::string* which) {
  const std::string chosen = cpu_gemm_path();
  const std::string name = chosen.substr(0, chosen.find(' '));
  double best = 0;
  for (const char* p : {"openblas", "onednn"}) {
    if (std::string(p) == "onednn" && !cpu::have_onednn()) continue;
    set_cpu_gemm_path(p);
    const double rate = measure_sgemm_flops(1024, 1.0);
    if (rate > best) best = rate, *which = p;
  }
  if (std::getenv("XIRANG_CPU_GEMM")) set_cpu_gemm_path(std::getenv("XIRANG_CPU_GEMM"));
  else set_cpu_gemm_path("auto");
  if (cpu_gemm_path().substr(0, name.size()) != name)
    fail(ErrorKind::Internal, "train_bench: the GEMM path changed from ", chosen, " to ", cpu_gemm_path());
  return best;
}

RunTime time_run(const std::vector<std::string>& overrides, double peak) {
  Config c = load_config(std::string(XIRANG_BENCH_CONFIG_DIR) + "/" + config_file, overrides);
  validate(c, 1);
  TrainerOptions opts;
  opts.print = false;
  opts.peak = PeakFlops{peak, "measured sgemm"};
  Trainer t(c, opts);
  const double cpu0 = process_cpu_seconds();
  TrainResult r = t.run();
  const double cpu_ms = (process_cpu_seconds() - cpu0) * 1e3 / double(r.steps.size());
  std::vector<double> ms;
  for (size_t i = 1; i < r.steps.size(); ++i) ms.push_back(r.steps[i].step_ms);
  return {bench::median(ms), cpu_ms, t.model().flops_per_token()};
}

// Runs without and with `extra` alternately (off first in even pairs, on
// first in odd ones), `pairs` times: the ratio of
// each pair's median step times shares the machine's noise of that moment.
// The CPU time the process used per step is much less sensitive to other
// processes on a shared machine than wall time: its ratio is printed too.
void print_overhead(const Shape2& s, const std::vector<std::string>& base, const std::vector<std::string>& extra,
                    int pairs, double peak) {
  std::vector<std::string> with = base;
  with.insert(with.end(), extra.begin(), extra.end());
  std::vector<double> off, on, ratios, cpu_ratios;
  std::string per_pair, cpu_per_pair;
  for (int i = 0; i < pairs; ++i) {
    // The order alternates too: the second run of a pair may find the machine warmer.
    RunTime a, b;
    if (i % 2 == 0) {
      a = time_run(base, peak);
      b = time_run(with, peak);
    } else {
      b = time_run(with, peak);
      a = time_run(base, peak);
    }
    off.push_back(a.median_ms);
    on.push_back(b.median_ms);
    ratios.push_back(b.median_ms / a.median_ms);
    cpu_ratios.push_back(b.cpu_ms_per_step / a.cpu_ms_per_step);
    char buf[16];
    std::snprintf(buf, sizeof buf, "%s%.3f", i ? " " : "", ratios.back());
    per_pair += buf;
    std::snprintf(buf, sizeof buf, "%s%.3f", i ? " " : "", cpu_ratios.back());
    cpu_per_pair += buf;
  }
  std::printf("| %d x %d | %.1f | %.1f | %s | %.3f | %s | %.3f |\n", s.batch, s.seq, bench::median(off),
              bench::median(on), per_pair.c_str(), bench::median(ratios), cpu_per_pair.c_str(),
              bench::median(cpu_ratios));
  std::fflush(stdout);
}

// --overhead trace|op_profile: the settings that turn the feature on for every timed step.
std::vector<std::string> overhead_sets(const std::string& what, const std::filesystem::path& dir, int steps) {
  if (what == "trace")
    return {"metrics.trace=" + (dir / "trace").string(), "metrics.trace_steps=1-" + std::to_string(steps + 1)};
  if (what == "op_profile") return {"metrics.op_profile=true"};
  if (what == "recompute_selective") return {"train.recompute=selective"};
  if (what == "recompute_full") return {"train.recompute=full"};
  std::fprintf(stderr, "train_bench: --overhead takes trace, op_profile, recompute_selective or recompute_full, not '%s'\n",
               what.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  int steps = 3, pairs = 5;
  std::string shapes = "4x64,8x256", overhead;
  std::vector<std::string> sets;  // extra config overrides, e.g. precision.dtype=bf16
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--shapes" && i + 1 < argc) shapes = argv[++i];
    else if (a == "--set" && i + 1 < argc) sets.push_back(argv[++i]);
    else if (a == "--overhead" && i + 1 < argc) overhead = argv[++i];
    else if (a == "--pairs" && i + 1 < argc) pairs = std::max(1, std::atoi(argv[++i]));
    else if (a == "--config" && i + 1 < argc) config_file = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: train_bench [--steps N] [--shapes BxT,...] [--set section.key=value ...] [--config FILE]\n"
                   "                   [--overhead trace|op_profile|recompute_selective|recompute_full [--pairs N]]\n");
      return 2;
    }
  }
  try {
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / ("xirang_bench_" + std::to_string(::getpid()));
    bench::write_random_tokens((dir / "train").string(), "gpt2", 50257, 1 << 20, 1);
    const std::string path = cpu_gemm_path();
    std::string peak_path;
    const double peak = sgemm_peak(&peak_path);
    std::printf("sgemm peak measured in this run: %.1f GFLOP/s (%s); CPU GEMM path: %s\n", peak / 1e9,
                peak_path.c_str(), path.c_str());
    if (overhead.empty())
      std::printf("| B x T | tokens/step | step ms (median) | tokens/s | MFU vs sgemm |\n|---|---|---|---|---|\n");
    else
      std::printf("%s on against off, %d alternating pairs per shape (ratio: step time on / off)\n"
                  "| B x T | off ms (median) | on ms (median) | wall ratio per pair | median | CPU-time ratio per pair | median |\n"
                  "|---|---|---|---|---|---|---|\n",
                  overhead.c_str(), pairs);
    for (const Shape2& s : parse_shapes(shapes)) {
      std::vector<std::string> o = {"train.micro_batch=" + std::to_string(s.batch),
                                    "train.global_batch=" + std::to_string(s.batch),
                                    "train.seq_len=" + std::to_string(s.seq), "train.steps=" + std::to_string(steps + 1),
                                    "train.eval_every=0", "data.train=" + (dir / "train").string(), "data.val=",
                                    "metrics.jsonl="};
      o.insert(o.end(), sets.begin(), sets.end());
      if (!overhead.empty()) {
        print_overhead(s, o, overhead_sets(overhead, dir, steps), pairs, peak);
        continue;
      }
      const RunTime run = time_run(o, peak);
      const double med = run.median_ms;
      const double tokens = double(s.batch) * s.seq;
      const double tps = tokens / (med / 1e3);
      const double mfu = run.flops_per_token * tps / peak;
      std::printf("| %d x %d | %.0f | %.0f | %.0f | %.1f%% |\n", s.batch, s.seq, tokens, med, tps, 100 * mfu);
      std::fflush(stdout);
    }
    fs::remove_all(dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "train_bench: %s: %s\n", error_kind_name(e.kind()), e.what());
    return 1;
  }
  return 0;
}
