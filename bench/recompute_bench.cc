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
  std::vector<double> ms, cpu_ms, ratio, cpu_ratio;  // per timed round; ratios to none's
};

DType model_dtype_of(Precision p) {
  return p == Precision::BF16 ? DType::BF16 : p == Precision::FP16 ? DType::F16 : DType::F32;
}

// The whole model under `r`, in arenas of its own, initialised from the config's seed.
Built build(const Config& cfg, const ModelDims& dims, DType dt, Recompute r) {
  Built b;
  b.mode = r;
  b.chunk = model_arch(dims.arch).make_chunk(dims, ChunkPlacement::whole(dims.n_layer), dt,
                                             ChunkBatch{.micro_batch = cfg.train.micro_batch, .seq_len = cfg.seq_len(), .recompute = r}, {});
  Arena mp = Arena::measuring("p"), mg = Arena::measuring("g"), ma = Arena::measuring("a");
  b.chunk->layout_parameters(mp, mg);
  b.chunk->layout_activations(ma);
  b.params = Arena("parameters", mp.used());
  b.grads = Arena("gradients", mg.used());
  b.acts = Arena("activations", ma.used());
  b.chunk->layout_parameters(b.params, b.grads);
  b.chunk->layout_activations(b.acts);
  b.chunk->init_parameters(cfg.train.seed);
  return b;
}

// `rounds` timed rounds (after one warm-up round: first touches of the
// arenas) of every mode's forward and backward, the order rotating. Returns
// whether every round's losses were bitwise equal across the modes.
bool time_rounds(std::vector<Built>& runs, const Tensor& tok, const Tensor& tgt, int rounds) {
  const double dloss = 1.0 / double(tok.numel());
  const KernelContext ctx;
  const int modes = int(runs.size());
  bool bitwise = true;
  for (int round = 0; round <= rounds; ++round) {
    std::vector<double> loss(static_cast<size_t>(modes)), ms(static_cast<size_t>(modes)), cpu(static_cast<size_t>(modes));
    for (int k = 0; k < modes; ++k) {
      const size_t i = size_t((k + round) % modes);
      Built& b = runs[i];
      const double c0 = process_cpu_seconds(), t0 = now_seconds();
      b.chunk->forward(ctx, 0, tok, tgt, dloss);
      loss[i] = b.chunk->take_loss(ctx);
      b.chunk->backward(ctx, 0, tok, GradPhase::Final);
      ms[i] = (now_seconds() - t0) * 1e3;
      cpu[i] = (process_cpu_seconds() - c0) * 1e3;
    }
    for (int i = 1; i < modes; ++i) bitwise = bitwise && std::memcmp(&loss[0], &loss[size_t(i)], sizeof(double)) == 0;
    if (round == 0) continue;
    for (size_t i = 0; i < size_t(modes); ++i) {
      runs[i].ms.push_back(ms[i]);
      runs[i].cpu_ms.push_back(cpu[i]);
      runs[i].ratio.push_back(ms[i] / ms[0]);
      runs[i].cpu_ratio.push_back(cpu[i] / cpu[0]);
    }
  }
  return bitwise;
}

void print_table(const std::vector<Built>& runs) {
  std::printf("| mode | ms (median) | ms (min) | wall ratio to none per round | median | CPU-time ratio median | ratio of minimums |\n"
              "|---|---|---|---|---|---|---|\n");
  auto min_of = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  for (const Built& b : runs) {
    std::string per;
    for (double r : b.ratio) {
      char buf[16];
      std::snprintf(buf, sizeof buf, "%s%.3f", per.empty() ? "" : " ", r);
      per += buf;
    }
    std::printf("| %s | %.1f | %.1f | %s | %.3f | %.3f | %.3f |\n", recompute_name(b.mode), bench::median(b.ms),
                min_of(b.ms), per.c_str(), bench::median(b.ratio), bench::median(b.cpu_ratio),
                min_of(b.ms) / min_of(runs[0].ms));
  }
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
    const ModelDims& dims = cfg.model;
    const DType dt = model_dtype_of(cfg.precision.dtype);
    std::vector<Built> runs;
    for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) runs.push_back(build(cfg, dims, dt, r));
    const int64_t n = int64_t(batch) * seq;
    std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      tokens[size_t(i)] = int32_t(rng_below(1, 1, uint64_t(i), uint64_t(dims.vocab_size)));
      targets[size_t(i)] = int32_t(rng_below(1, 2, uint64_t(i), uint64_t(dims.vocab_size)));
    }
    const Tensor tok(tokens.data(), {batch, seq}, DType::I32), tgt(targets.data(), {batch, seq}, DType::I32);
    const bool bitwise = time_rounds(runs, tok, tgt, rounds);
    std::printf("%s (%s), micro_batch %d x %d, forward + backward of one microbatch, %d interleaved rounds\n",
                file.c_str(), dtype_name(dt), batch, seq, rounds);
    print_table(runs);
    std::printf("losses bitwise equal across modes in every round: %s\n", bitwise ? "yes" : "NO");
    return bitwise ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "recompute_bench: %s: %s\n", error_kind_name(e.kind()), e.what());
    return 1;
  }
}
