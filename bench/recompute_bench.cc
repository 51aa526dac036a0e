// The step-time cost of activation recomputation (train.recompute), in one
// process: the whole model as one chunk under each mode, each timed over
// the forward and backward of one microbatch. The modes run interleaved,
// round by round (the order rotating), so that they share the machine's
// noise of the moment; each round gives a ratio to `none`, and the table
// reports medians, and the ratio of each mode's fastest round to none's
// (noise on a shared machine only adds time, so the minimum is the
// steadier estimate). Each round's losses must be bitwise equal across modes.
//
//   build/bin/recompute_bench [--config gpt2_124m.yaml] [--shape 2x128] [--rounds 7] [--set section.key=value ...]
//
// --config names a file of configs/; the model, dtype and seed come from it.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/clock.h"
#include "core/omp_wait.h"
#include "core/rng.h"
#include "runtime/config/config.h"
#include "runtime/config/model_layout.h"

using namespace xirang;

namespace {

double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct Built {
  Recompute mode;
  std::unique_ptr<ModelChunk> chunk;
  Arena params, grads, acts;
  std::vector<double> ms, cpu_ms;
};

DType model_dtype_of(Precision p) {
  return p == Precision::BF16 ? DType::BF16 : p == Precision::FP16 ? DType::F16 : DType::F32;
}

}  // namespace

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  std::string file = "gpt2_124m.yaml";
  int batch = 2, seq = 128, rounds = 7;
  std::vector<std::string> sets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) file = argv[++i];
    else if (a == "--shape" && i + 1 < argc && std::sscanf(argv[i + 1], "%dx%d", &batch, &seq) == 2) ++i;
    else if (a == "--rounds" && i + 1 < argc) rounds = std::max(1, std::atoi(argv[++i]));
    else if (a == "--set" && i + 1 < argc) sets.push_back(argv[++i]);
    else {
      std::fprintf(stderr, "usage: recompute_bench [--config FILE] [--shape BxT] [--rounds N] [--set section.key=value ...]\n");
      return 2;
    }
  }
  try {
    sets.push_back("train.micro_batch=" + std::to_string(batch));
    sets.push_back("train.seq_len=" + std::to_string(seq));
    const Config cfg = load_config(std::string(XIRANG_BENCH_CONFIG_DIR) + "/" + file, sets);
    const ModelDims dims = model_dims(cfg.model);
    const DType dt = model_dtype_of(cfg.precision.dtype);
    std::vector<Built> runs;
    for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      Built b;
      b.mode = r;
      b.chunk = model_arch(dims.arch).make_chunk(dims, ChunkPlacement::whole(dims.n_layer), dt,
                                                 ChunkBatch{batch, seq, 1, r}, {});
      Arena mp = Arena::measuring("p"), mg = Arena::measuring("g"), ma = Arena::measuring("a");
      b.chunk->layout_parameters(mp, mg);
      b.chunk->layout_activations(ma);
      b.params = Arena("parameters", mp.used());
      b.grads = Arena("gradients", mg.used());
      b.acts = Arena("activations", ma.used());
      b.chunk->layout_parameters(b.params, b.grads);
      b.chunk->layout_activations(b.acts);
      b.chunk->init_parameters(cfg.train.seed);
      runs.push_back(std::move(b));
    }
    const int64_t n = int64_t(batch) * seq;
    std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      tokens[size_t(i)] = int32_t(rng_below(1, 1, uint64_t(i), uint64_t(dims.vocab_size)));
      targets[size_t(i)] = int32_t(rng_below(1, 2, uint64_t(i), uint64_t(dims.vocab_size)));
    }
    const Tensor tok(tokens.data(), {batch, seq}, DType::I32), tgt(targets.data(), {batch, seq}, DType::I32);
    KernelContext ctx;
    std::vector<double> ratio[3], cpu_ratio[3];
    bool bitwise = true;
    // Round 0 warms up (first touches of the arenas) and is left out.
    for (int round = 0; round <= rounds; ++round) {
      double loss[3], ms[3], cpu[3];
      for (int k = 0; k < 3; ++k) {
        const int i = (k + round) % 3;
        Built& b = runs[size_t(i)];
        const double c0 = process_cpu_seconds(), t0 = now_seconds();
        b.chunk->forward(ctx, 0, tok, tgt, 1.0 / double(n));
        loss[i] = b.chunk->take_loss(ctx);
        b.chunk->backward(ctx, 0, tok, GradPhase::Final);
        ms[i] = (now_seconds() - t0) * 1e3;
        cpu[i] = (process_cpu_seconds() - c0) * 1e3;
      }
      bitwise = bitwise && std::memcmp(&loss[0], &loss[1], sizeof(double)) == 0 &&
                std::memcmp(&loss[0], &loss[2], sizeof(double)) == 0;
      if (round == 0) continue;
      for (int i = 0; i < 3; ++i) {
        runs[size_t(i)].ms.push_back(ms[i]);
        runs[size_t(i)].cpu_ms.push_back(cpu[i]);
        ratio[i].push_back(ms[i] / ms[0]);
        cpu_ratio[i].push_back(cpu[i] / cpu[0]);
      }
    }
    std::printf("%s (%s), micro_batch %d x %d, forward + backward of one microbatch, %d interleaved rounds\n",
                file.c_str(), dtype_name(dt), batch, seq, rounds);
    std::printf("| mode | ms (median) | ms (min) | wall ratio to none per round | median | CPU-time ratio median | ratio of minimums |\n"
                "|---|---|---|---|---|---|---|\n");
    auto min_of = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
    for (int i = 0; i < 3; ++i) {
      std::string per;
      for (double r : ratio[i]) {
        char buf[16];
        std::snprintf(buf, sizeof buf, "%s%.3f", per.empty() ? "" : " ", r);
        per += buf;
      }
      std::printf("| %s | %.1f | %.1f | %s | %.3f | %.3f | %.3f |\n", recompute_name(runs[size_t(i)].mode),
                  bench::median(runs[size_t(i)].ms), min_of(runs[size_t(i)].ms), per.c_str(), bench::median(ratio[i]),
                  bench::median(cpu_ratio[i]), min_of(runs[size_t(i)].ms) / min_of(runs[0].ms));
    }
    std::printf("losses bitwise equal across modes in every round: %s\n", bitwise ? "yes" : "NO");
    return bitwise ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "recompute_bench: %s: %s\n", error_kind_name(e.kind()), e.what());
    return 1;
  }
}
