// Training throughput of GPT-2 124M on the CPU backend, as tokens/s and MFU
// against the sgemm rate measured in the same run (the limit a step built
// from matrix products can approach).
//
//   build/bin/train_bench [--steps N] [--shapes 4x64,8x256] [--set section.key=value ...] [--config llama_demo.yaml]
//   build/bin/train_bench --overhead trace|op_profile [--pairs 5] ...   // the feature on against off, as ratios
//   build/bin/train_bench --overhead trace|op_profile --interleave [--pairs 20] ...  // on and off steps of one run
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
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/error.h"
#include "core/omp_wait.h"
#include "core/timeline.h"
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

// A one-rank trainer of the bench's config with `overrides`, quiet, its MFU against `peak`.
std::unique_ptr<Trainer> bench_trainer(const std::vector<std::string>& overrides, double peak) {
  Config c = load_config(std::string(XIRANG_BENCH_CONFIG_DIR) + "/" + config_file, overrides);
  validate(c, 1);
  TrainerOptions opts;
  opts.print = false;
  opts.peak = PeakFlops{peak, "measured sgemm"};
  return std::make_unique<Trainer>(c, opts);
}

RunTime time_run(const std::vector<std::string>& overrides, double peak) {
  const std::unique_ptr<Trainer> trainer = bench_trainer(overrides, peak);
  Trainer& t = *trainer;
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

// --interleave: the feature on for one step of each adjacent pair of steps
// of one run and off for the other (which one alternates from pair to
// pair), by switching the trainer's timeline at each step's start. Adjacent
// steps of one process share the machine's state far more closely than two
// processes do, so the ratio resolves costs well under the 2% that separate
// runs cannot. A control run switches nothing and is classified the same
// way: its ratio is the method's own noise. What this leaves out is the
// trace file's writing at the end of its window (once per window, not per
// step), which the separate runs include, and the difference between an
// idle timeline (the off steps here) and none (a run with both features
// off): about 1.5 ns a span site and 0.3 ns an op site (timeline_bench).
class StepToggle final : public StepObserver {
 public:
  StepToggle(Timeline& tl, bool trace, bool control) : tl_(tl), trace_(trace), control_(control) {}
  // Step 1 (one-time costs) is neither; steps 2k + 2 and 2k + 3 form pair k.
  static bool is_on(int step) { return step >= 2 && (step - 2) % 2 == ((step - 2) / 2) % 2; }
  void on_step_begin(int step) override {
    cpu0_ = process_cpu_seconds();
    const bool on = !control_ && is_on(step);
    tl_.set_tracing(trace_ && on);
    tl_.set_profiling(!trace_ && on);
  }
  void on_step(StepMetrics& m) override {
    cpu_ms.push_back(1e3 * (process_cpu_seconds() - cpu0_));
    if (control_) return;
    if (trace_) {
      tl_.set_tracing(false);
      sites = std::max<int64_t>(sites, int64_t(tl_.take_spans().size()));  // what a trace window would take and write
    } else {
      tl_.set_profiling(false);
      if (m.ops)
        for (int64_t n : m.ops->calls) ops_in_step += n;
      sites = std::max(sites, ops_in_step);
      ops_in_step = 0;
    }
  }

  std::vector<double> cpu_ms;  // per step: the process's CPU time (all threads), less sensitive to other processes
  int64_t sites = 0;           // the most spans (trace) or op calls (op_profile) one step recorded
  int64_t ops_in_step = 0;

 private:
  Timeline& tl_;
  bool trace_, control_;
  double cpu0_ = 0;
};

struct PairRatios {
  double off_ms = 0, on_ms = 0, median = 0, lo = 0, hi = 0;  // medians of the steps; ratios on / off
  double cpu_median = 0;                                     // the pairs' CPU-time ratios on / off
  int64_t sites = 0;                                         // recorded per on-step
};

volatile int site_sink = 0;

// Nanoseconds one recording site costs (a span kept, or an op timed and
// summed), an empty loop's time subtracted: the direct cost of the
// instrumentation, which load on the machine can only inflate
// (bench/timeline_bench.cc tabulates every case).
double recording_site_ns(bool trace) {
  Timeline tl;
  if (trace) tl.set_tracing(true);
  else tl.set_profiling(true);
  const long n = 200000;
  const double empty = bench::ns_per_call(n, [](long i) { site_sink = int(i); });
  const double site = trace ? bench::ns_per_call(n, [&](long i) {
    SpanScope sp(&tl, "forward", Track::Main, int(i & 7), 0);
    site_sink = int(i);
    if ((i & 0xffff) == 0) tl.take_spans();
  })
                            : bench::ns_per_call(n, [&](long i) {
                                OpScope op(&tl, nullptr, OpKind::Matmul);
                                site_sink = int(i);
                              });
  return std::max(0.0, site - empty);
}

PairRatios interleaved_run(const std::vector<std::string>& base, bool trace, bool control, int pairs, double peak) {
  std::vector<std::string> o = base;
  o.push_back("train.steps=" + std::to_string(1 + 2 * pairs));
  // Attaches the trainer's timeline (with neither feature on, the step's
  // sites see none); StepToggle decides at every step what it records.
  o.push_back("metrics.op_profile=true");
  const std::unique_ptr<Trainer> trainer = bench_trainer(o, peak);
  Trainer& t = *trainer;
  auto toggle = std::make_unique<StepToggle>(t.timeline(), trace, control);
  const StepToggle& seen = *toggle;
  t.add_observer(std::move(toggle));
  const TrainResult r = t.run();
  std::vector<double> on, off, ratios, cpu_ratios;
  for (int k = 0; k < pairs; ++k) {
    const int a = 2 * k + 2, b = a + 1;  // step numbers; r.steps[i] is step i + 1
    const double ma = r.steps[size_t(a - 1)].step_ms, mb = r.steps[size_t(b - 1)].step_ms;
    const double m_on = StepToggle::is_on(a) ? ma : mb, m_off = StepToggle::is_on(a) ? mb : ma;
    on.push_back(m_on);
    off.push_back(m_off);
    ratios.push_back(m_on / m_off);
    const double ca = seen.cpu_ms[size_t(a - 1)], cb = seen.cpu_ms[size_t(b - 1)];
    cpu_ratios.push_back(StepToggle::is_on(a) ? ca / cb : cb / ca);
  }
  std::sort(ratios.begin(), ratios.end());
  // The middle half of the pairs' ratios: their spread, without the odd pair a daemon woke in.
  return {bench::median(off), bench::median(on), bench::median(ratios), ratios[ratios.size() / 4],
          ratios[(3 * ratios.size()) / 4], bench::median(cpu_ratios), seen.sites};
}

void print_interleaved(const Shape2& s, const std::vector<std::string>& base, const std::string& what, int pairs,
                       double peak) {
  if (what != "trace" && what != "op_profile") {
    std::fprintf(stderr, "train_bench: --interleave takes --overhead trace or op_profile, not '%s'\n", what.c_str());
    std::exit(2);
  }
  const PairRatios f = interleaved_run(base, what == "trace", false, pairs, peak);
  const PairRatios c = interleaved_run(base, what == "trace", true, pairs, peak);
  std::printf("| %d x %d | %.1f | %.1f | %.4f (%.4f .. %.4f) | %.4f (%.4f .. %.4f) | %.4f | %.4f |\n", s.batch, s.seq,
              f.off_ms, f.on_ms, f.median, f.lo, f.hi, c.median, c.lo, c.hi, f.cpu_median, c.cpu_median);
  const double ns = recording_site_ns(what == "trace");
  std::printf("  direct cost: %lld %s per step x %.1f ns = %.3f ms, %.3f%% of the off step\n", (long long)f.sites,
              what == "trace" ? "spans" : "op calls", ns, f.sites * ns * 1e-6, 100 * f.sites * ns * 1e-6 / f.off_ms);
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
  bool interleave = false;
  std::string shapes = "4x64,8x256", overhead;
  std::vector<std::string> sets;  // extra config overrides, e.g. precision.dtype=bf16
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--shapes" && i + 1 < argc) shapes = argv[++i];
    else if (a == "--set" && i + 1 < argc) sets.push_back(argv[++i]);
    else if (a == "--overhead" && i + 1 < argc) overhead = argv[++i];
    else if (a == "--interleave") interleave = true;
    else if (a == "--pairs" && i + 1 < argc) pairs = std::max(1, std::atoi(argv[++i]));
    else if (a == "--config" && i + 1 < argc) config_file = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: train_bench [--steps N] [--shapes BxT,...] [--set section.key=value ...] [--config FILE]\n"
                   "                   [--overhead trace|op_profile|recompute_selective|recompute_full [--pairs N]]\n"
                   "                   [--overhead trace|op_profile --interleave [--pairs N]]\n");
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
    if (interleave && overhead.empty()) {
      std::fprintf(stderr, "train_bench: --interleave needs --overhead trace or op_profile\n");
      return 2;
    }
    if (interleave)
      std::printf("%s on against off in adjacent steps of one run, %d pairs per shape (ratio: step time on / off;\n"
                  "median and middle half of the pairs); control: the same run with nothing switched\n"
                  "| B x T | off ms (median) | on ms (median) | ratio on / off | control ratio | CPU-time ratio | control |\n"
                  "|---|---|---|---|---|---|---|\n",
                  overhead.c_str(), pairs);
    else if (overhead.empty())
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
      if (interleave) {
        o.erase(std::remove_if(o.begin(), o.end(), [](const std::string& x) { return x.rfind("train.steps=", 0) == 0; }),
                o.end());
        print_interleaved(s, o, overhead, pairs, peak);
        continue;
      }
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
