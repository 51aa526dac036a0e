// Data loader throughput against what GPT-2 124M training can consume.
//
//   build/bin/loader_bench [--seconds 3] [--threads 2]
//
// 1. Raw throughput: a PrefetchLoader over a 64M-token random uint16 dataset
//    (GPT-2 vocabulary, seq_len 1024, micro_batch 8) consumed as fast as
//    possible, in tokens/s.
// 2. The most gpt2_124m training could consume on this machine: the sgemm
//    rate measured in the same run divided by the model's training FLOPs per
//    token (100% MFU, an upper bound on consumption).
// 3. Adaptation: with 20 ms injected per sample read and a consumer that
//    computes 30 ms per microbatch of one sample, the depth the loader chose
//    and the share of time the consumer waited.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "core/omp_wait.h"
#include "core/clock.h"
#include "models/model.h"
#include "runtime/data/loader.h"
#include "runtime/observe/metrics.h"

using namespace xirang;

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  double seconds = 3;
  int threads = 2;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--seconds" && i + 1 < argc) seconds = std::stod(argv[++i]);
    else if (a == "--threads" && i + 1 < argc) threads = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: loader_bench [--seconds S] [--threads N]\n");
      return 2;
    }
  }
  try {
    namespace fs = std::filesystem;
    const std::string dir = (fs::temp_directory_path() / ("xirang_loader_bench_" + std::to_string(::getpid()))).string();
    bench::write_random_tokens(dir + "/train", "gpt2", 50257, size_t(1) << 26, 7);
    TokenDataset data = TokenDataset::open(dir + "/train");

    const int T = 1024, B = 8;
    LoaderSpec spec;
    spec.seq_len = T;
    spec.seed = 1;
    spec.micro_batch = B;
    spec.global_batch = B;
    spec.microbatches = 1;
    LoaderOptions opts;
    opts.threads = threads;
    std::vector<int32_t> tokens(size_t(B) * T), targets(size_t(B) * T);
    double loader_tps = 0;
    {
      PrefetchLoader loader(data, spec, opts);
      int64_t step = 0;
      Stopwatch sw;
      while (sw.seconds() < seconds) loader.next(step++, 0, tokens.data(), targets.data());
      loader_tps = double(step) * B * T / sw.seconds();
    }
    const double peak = measure_sgemm_flops(1024, 1.0);
    const ModelDims s124{.n_layer = 12, .n_head = 12, .d_model = 768, .max_seq_len = 1024, .vocab_size = 50257};
    const auto model = model_arch("gpt2").make_chunk(s124, ChunkPlacement::whole(s124.n_layer), DType::F32,
                                                     ChunkBatch{.micro_batch = B, .seq_len = T}, {});
    const double consume = peak / model->flops_per_token();
    std::printf("loader (%d threads, seq_len %d, micro_batch %d): %.0f tokens/s\n", threads, T, B, loader_tps);
    std::printf("gpt2_124m at 100%% MFU of the measured sgemm rate (%.1f GFLOP/s): %.0f tokens/s\n", peak / 1e9,
                consume);
    std::printf("headroom: the loader supplies %.0fx what training can consume\n", loader_tps / consume);

    // Slow reads (20 ms injected per sample) under a consumer computing 30 ms
    // per one-sample microbatch: prefetching on (adaptive depth) and off.
    LoaderSpec slow = spec;
    slow.micro_batch = 1;
    slow.global_batch = 1;
    std::vector<int32_t> t1(static_cast<size_t>(T)), g1(static_cast<size_t>(T));
    for (bool enabled : {true, false}) {
      LoaderOptions lo;
      lo.enabled = enabled;
      lo.threads = threads;
      lo.read_delay_ms = 20;
      lo.prefetch_min = 1;
      lo.prefetch_max = 8;
      PrefetchLoader loader(data, slow, lo);
      Stopwatch total;
      double waited = 0;
      for (int64_t step = 0; step < 40; ++step) {
        loader.next(step, 0, t1.data(), g1.data());
        const double w = loader.take_wait_ms();
        if (step >= 5) waited += w;
        if (step == 4) total.restart();
        std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the consumer's compute
      }
      std::printf("20 ms reads, 30 ms compute per microbatch, prefetch %s: depth %d, waited %.2f%% of the time after warm-up\n",
                  enabled ? "on " : "off", loader.depth(), 100 * waited / total.ms());
    }
    fs::remove_all(dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "loader_bench: %s: %s\n", error_kind_name(e.kind()), e.what());
    return 1;
  }
  return 0;
}
