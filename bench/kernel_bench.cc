// bench/kernel_bench.cc: times of the CPU flash-attention pair and the fused
// cross-entropy on training shapes (median of --reps runs after one warm-up),
// F32, with the OpenMP threads the environment gives.
//
//   OMP_NUM_THREADS=2 build/bin/kernel_bench --B 8 --T 256 --H 4 --D 64 --V 50257 --reps 5
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"

using namespace xirang;

namespace {

std::vector<float> random_floats(size_t n, uint64_t seed, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * (float(rng_below(seed, 1, i, 1u << 20)) / float(1 << 19) - 1.f);
  return v;
}

template <class F>
double median_ms(int reps, F&& f) {
  f();
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return bench::median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t B = 8, T = 256, H = 4, D = 64, V = 50257;
  int reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (k == "--B") B = v;
    else if (k == "--T") T = v;
    else if (k == "--H") H = v;
    else if (k == "--D") D = v;
    else if (k == "--V") V = v;
    else if (k == "--reps") reps = int(v);
    else {
      std::fprintf(stderr, "kernel_bench: unknown flag %s (expected --B --T --H --D --V --reps)\n", k.c_str());
      return 2;
    }
  }
  KernelContext ctx;
  const int64_t C = H * D, N = B * T, Vp = (V + 63) / 64 * 64;
  std::vector<float> qkv = random_floats(size_t(B * T * 3 * C), 1, 2.f), out(size_t(B * T * C));
  std::vector<float> lse(static_cast<size_t>(B * H * T));
  std::vector<float> dout = random_floats(size_t(B * T * C), 2, 1.f), dqkv(qkv.size());
  Tensor tq(qkv.data(), {B, T, 3 * C}, DType::F32), to(out.data(), {B, T, C}, DType::F32),
      tl(lse.data(), {B, H, T}, DType::F32), tdo(dout.data(), {B, T, C}, DType::F32),
      tdq(dqkv.data(), {B, T, 3 * C}, DType::F32);
  const double fwd = median_ms(reps, [&] { flash_attention_forward(ctx, to, tl, tq, int(H), 0); });
  const double bwd = median_ms(reps, [&] { flash_attention_backward(ctx, tdq, tdo, tq, to, tl, int(H), 0); });
  std::vector<float> logits = random_floats(size_t(N * Vp), 3, 4.f), losses(static_cast<size_t>(N));
  std::vector<int32_t> targets(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) targets[size_t(i)] = int32_t(rng_below(4, 1, uint64_t(i), uint64_t(V)));
  Tensor tlog(logits.data(), {N, Vp}, DType::F32), tlos(losses.data(), {N}, DType::F32),
      ttg(targets.data(), {N}, DType::I32);
  // In place over the logits, as the model calls it (the values stay bounded: gradients after the first run).
  const double ce =
      median_ms(reps, [&] { cross_entropy_forward_backward(ctx, tlos, tlog, tlog, ttg, V, 1.0 / double(N)); });
  std::printf("threads %d  B %lld T %lld H %lld D %lld V %lld: ", omp_get_max_threads(), (long long)B, (long long)T,
              (long long)H, (long long)D, (long long)V);
  std::printf("attention fwd %.2f ms  bwd %.2f ms  cross_entropy %.2f ms\n", fwd, bwd, ce);
  return 0;
}
