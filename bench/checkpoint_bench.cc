// The cost of saving a checkpoint of GPT-2 124M: the step that saves against
// a normal step, asynchronous and synchronous, in one run.
//
//   build/bin/checkpoint_bench [--steps 7] [--every 3] [--batch 4x64]
//
// Trains configs/gpt2_124m.yaml on a random token stream with
// checkpoint.every, once with checkpoint.async=true and once false, and
// reports the median normal step, each saving step and their ratio (the
// project requires the asynchronous saving step under 1.2x a normal step).
// The first step (warm-up) is left out of the medians.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/omp_wait.h"
#include "runtime/config/config.h"
#include "runtime/trainer.h"

using namespace xirang;

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  int steps = 7, every = 3, B = 4, T = 64;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::stoi(argv[++i]);
    else if (a == "--every" && i + 1 < argc) every = std::stoi(argv[++i]);
    else if (a == "--batch" && i + 1 < argc) std::sscanf(argv[++i], "%dx%d", &B, &T);
    else {
      std::fprintf(stderr, "usage: checkpoint_bench [--steps N] [--every K] [--batch BxT]\n");
      return 2;
    }
  }
  try {
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / ("xirang_ckpt_bench_" + std::to_string(::getpid()));
    bench::write_random_tokens((dir / "train").string(), "gpt2", 50257, size_t(1) << 20, 3);
    std::printf("gpt2_124m, batch %d x %d, a checkpoint every %d steps\n", B, T, every);
    std::printf("| mode | normal step ms (median) | saving step ms | ratio | stall ms | checkpoint size |\n"
                "|---|---|---|---|---|---|\n");
    for (bool async : {true, false}) {
      const fs::path ck = dir / (async ? "ck_async" : "ck_sync");
      Config c = load_config(std::string(XIRANG_BENCH_CONFIG_DIR) + "/gpt2_124m.yaml",
                             {"train.micro_batch=" + std::to_string(B), "train.global_batch=" + std::to_string(B),
                              "train.seq_len=" + std::to_string(T), "train.steps=" + std::to_string(steps),
                              "train.eval_every=0", "data.train=" + (dir / "train").string(), "data.val=",
                              "metrics.jsonl=", "checkpoint.dir=" + ck.string(),
                              "checkpoint.every=" + std::to_string(every), "checkpoint.resume=none",
                              std::string("checkpoint.async=") + (async ? "true" : "false")});
      validate(c, 1);
      TrainerOptions o;
      o.print = false;
      o.peak = PeakFlops{1e11, "bench"};
      Trainer t(c, o);
      TrainResult r = t.run();
      std::vector<double> normal, saving, stall;
      for (size_t i = 1; i < r.steps.size(); ++i) {
        const StepMetrics& s = r.steps[i];
        // The last step's save is followed by the end-of-run wait; compare the periodic ones.
        if (s.step == steps) continue;
        if (s.ckpt_stall_ms > 0) {
          saving.push_back(s.step_ms);
          stall.push_back(s.ckpt_stall_ms);
        } else {
          normal.push_back(s.step_ms);
        }
      }
      std::string trace;
      for (const StepMetrics& s : r.steps) {
        trace += ' ';
        trace += std::to_string(int(s.step_ms));
        if (s.ckpt_stall_ms > 0) trace += '*';
      }
      std::fprintf(stderr, "%s step ms (* saves):%s\n", async ? "async" : "sync", trace.c_str());
      uintmax_t bytes = 0;
      for (auto& f : fs::recursive_directory_iterator(ck))
        if (f.is_regular_file()) bytes += f.file_size();
      const double n = bench::median(normal), sv = bench::median(saving);
      std::printf("| %s | %.0f | %.0f | %.2fx | %.0f | %.0f MB |\n", async ? "async" : "sync", n, sv, sv / n,
                  bench::median(stall), double(bytes) / 1e6);
      std::fflush(stdout);
    }
    fs::remove_all(dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "checkpoint_bench: %s: %s\n", error_kind_name(e.kind()), e.what());
    return 1;
  }
  return 0;
}
