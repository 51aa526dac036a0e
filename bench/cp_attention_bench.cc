// bench/cp_attention_bench.cc: the causal-attention work of each rank of a
// context-parallel group on the CPU, to measure the load balance of the
// head-tail split against the contiguous one (kernels/context_split.h).
//
// All ranks run in this one process, one after another, on the same
// threads: each rank's time is the median over --repeats of its
// cp_attention_forward + cp_attention_backward (f32). Head-tail gives every
// rank the same number of (query, key) pairs, so max/mean should be near 1;
// contiguous gives the last rank (2c - 1)/c of the mean. The one-rank flash
// pair on the whole sequence is timed too: (per-rank mean x c) / one-rank
// says what the split costs over doing the same work unsplit.
//
//   build/bin/cp_attention_bench [--cp 4] [--seq 4096] [--heads 8] [--kv-heads 2] [--head-dim 64] [--repeats 5]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/context_split.h"
#include "kernels/cp_attention.h"

using namespace xirang;

namespace {

std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float(rng_below(seed, 1, i, 2000001)) / 1e6f - 1.f;
  return v;
}

// Per-rank median milliseconds of forward + backward.
std::vector<double> time_ranks(const ContextSplit& split, int64_t B, int H, int KV, int64_t D, int repeats) {
  KernelContext ctx;
  const int c = split.ranks;
  const int64_t Tl = split.local_rows(), W = (H + 2 * KV) * D, K = 2 * KV * D, C = H * D;
  auto kv_all = random_floats(size_t(c * B * Tl * K), 11);
  auto dkv_all = kv_all;
  Tensor kv_t(kv_all.data(), {c, B, Tl, K}, DType::F32), dkv_t(dkv_all.data(), {c, B, Tl, K}, DType::F32);
  std::vector<double> ms(static_cast<size_t>(c), 0.0);
  for (int r = 0; r < c; ++r) {
    auto qkv = random_floats(size_t(B * Tl * W), 12 + r), dout = random_floats(size_t(B * Tl * C), 13 + r);
    std::vector<float> out(size_t(B * Tl * C)), lse(size_t(B * H * Tl)), dqkv(qkv.size());
    Tensor q(qkv.data(), {B, Tl, W}, DType::F32), o(out.data(), {B, Tl, C}, DType::F32);
    Tensor l(lse.data(), {B, H, Tl}, DType::F32), dq(dqkv.data(), {B, Tl, W}, DType::F32);
    Tensor dO(dout.data(), {B, Tl, C}, DType::F32);
    std::vector<double> runs;
    for (int i = 0; i < repeats; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      cp_attention_forward(ctx, o, l, q, kv_t, split, r, H, KV);
      cp_attention_backward(ctx, dq, dkv_t, dO, q, kv_t, o, l, split, r, H, KV);
      runs.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    ms[size_t(r)] = bench::median(runs);
  }
  return ms;
}

// Median milliseconds of flash_attention_forward + backward (f32) on the whole sequence.
double time_one_rank(int64_t T, int64_t B, int H, int KV, int64_t D, int repeats) {
  KernelContext ctx;
  const int64_t W = (H + 2 * KV) * D, C = H * D;
  auto qkv = random_floats(size_t(B * T * W), 12), dout = random_floats(size_t(B * T * C), 13);
  std::vector<float> out(size_t(B * T * C)), lse(size_t(B * H * T)), dqkv(qkv.size());
  Tensor q(qkv.data(), {B, T, W}, DType::F32), o(out.data(), {B, T, C}, DType::F32);
  Tensor l(lse.data(), {B, H, T}, DType::F32), dq(dqkv.data(), {B, T, W}, DType::F32);
  Tensor dO(dout.data(), {B, T, C}, DType::F32);
  std::vector<double> runs;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    flash_attention_forward(ctx, o, l, q, H, KV);
    flash_attention_backward(ctx, dq, dO, q, o, l, H, KV);
    runs.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return bench::median(runs);
}

int64_t arg(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = arg(argc, argv, "--seq", 4096), D = arg(argc, argv, "--head-dim", 64);
  const int H = int(arg(argc, argv, "--heads", 8)), KV = int(arg(argc, argv, "--kv-heads", 2));
  const int repeats = int(arg(argc, argv, "--repeats", 5)), only = int(arg(argc, argv, "--cp", 0));
  std::printf("cp attention, CPU f32: B 1, T %lld, H %d, KV %d, D %lld, median of %d (forward + backward)\n",
              (long long)T, H, KV, (long long)D, repeats);
  const double one = time_one_rank(T, 1, H, KV, D, repeats);
  std::printf("one rank (flash pair, whole sequence): %.0f ms\n", one);
  for (int c : {2, 4}) {
    if (only != 0 && c != only) continue;
    for (bool head_tail : {true, false}) {
      const std::vector<double> ms = time_ranks(ContextSplit::of(T, c, head_tail), 1, H, KV, D, repeats);
      double mx = 0, sum = 0;
      std::string per;
      for (double m : ms) {
        mx = std::max(mx, m);
        sum += m;
        per += " " + std::to_string(int64_t(m + 0.5));
      }
      const double mean = sum / double(ms.size());
      std::printf("c %d %-10s ms per rank:%s  max/mean %.3f  (expected %.3f)\n", c,
                  head_tail ? "head-tail" : "contiguous", per.c_str(), mx / mean,
                  head_tail ? 1.0 : double(2 * c - 1) / c);
      std::printf("  (per-rank mean x c) / one rank: %.2f\n", mean * c / one);
    }
  }
  return 0;
}
