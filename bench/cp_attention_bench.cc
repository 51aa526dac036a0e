// bench/cp_attention_bench.cc: the causal-attention work of each rank of a
// context-parallel group on the CPU, to measure the load balance of the
// head-tail split against the contiguous one (kernels/context_split.h).
//
// All ranks run in this one process, one after another, on the same
// threads: forward and backward are timed apart, and each rank's figure is
// the fastest of --repeats (other builds on a shared machine only ever add
// time; the fastest run is the one they disturbed least; the cpu line,
// forward + backward in process CPU time, also leaves out the time the
// threads waited for a core, but counts idle OpenMP threads' spinning, so
// it is steadiest with OMP_NUM_THREADS=1). Head-tail gives
// every rank the same number of (query, key) pairs, so max/mean should be near 1;
// contiguous gives the last rank (2c - 1)/c of the mean. The one-rank flash
// pair on the whole sequence is timed too (median): (per-rank mean x c) / one-rank
// says what the split costs over doing the same work unsplit.
//
//   build/bin/cp_attention_bench [--cp 4] [--seq 4096] [--heads 8] [--kv-heads 2] [--head-dim 64] [--repeats 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
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

// One rank's timed runs: forward and backward separately, and their sum per run.
struct RankTimes {
  std::vector<double> fwd, bwd, total;
  std::vector<double> cpu;  // forward + backward in the process's CPU time: blind to time spent descheduled
};

// The process's CPU time (all threads) in milliseconds.
double cpu_ms() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) * 1e-6;
}

// Every rank's forward and backward --repeats times; the repeats loop is
// the outer one, so load from other work on the machine falls on all ranks
// alike instead of on whichever rank ran at the time.
std::vector<RankTimes> time_ranks(const ContextSplit& split, int64_t B, int H, int KV, int64_t D, int repeats) {
  KernelContext ctx;
  const int c = split.ranks;
  const int64_t Tl = split.local_rows(), W = (H + 2 * KV) * D, K = 2 * KV * D, C = H * D;
  auto kv_all = random_floats(size_t(c * B * Tl * K), 11);
  auto dkv_all = kv_all;
  Tensor kv_t(kv_all.data(), {c, B, Tl, K}, DType::F32), dkv_t(dkv_all.data(), {c, B, Tl, K}, DType::F32);
  struct Rank {
    std::vector<float> qkv, dout, out, lse, dqkv;
  };
  std::vector<Rank> rk(static_cast<size_t>(c));
  for (int r = 0; r < c; ++r) {
    Rank& x = rk[size_t(r)];
    x.qkv = random_floats(size_t(B * Tl * W), 12 + r);
    x.dout = random_floats(size_t(B * Tl * C), 13 + r);
    x.out.resize(size_t(B * Tl * C));
    x.lse.resize(size_t(B * H * Tl));
    x.dqkv.resize(x.qkv.size());
  }
  std::vector<RankTimes> t(static_cast<size_t>(c));
  using clock = std::chrono::steady_clock;
  auto ms = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  for (int i = 0; i < repeats; ++i)
    for (int r = 0; r < c; ++r) {
      Rank& x = rk[size_t(r)];
      Tensor q(x.qkv.data(), {B, Tl, W}, DType::F32), o(x.out.data(), {B, Tl, C}, DType::F32);
      Tensor l(x.lse.data(), {B, H, Tl}, DType::F32), dq(x.dqkv.data(), {B, Tl, W}, DType::F32);
      Tensor dO(x.dout.data(), {B, Tl, C}, DType::F32);
      const double c0 = cpu_ms();
      const auto t0 = clock::now();
      cp_attention_forward(ctx, o, l, q, kv_t, split, r, H, KV);
      const auto t1 = clock::now();
      cp_attention_backward(ctx, dq, dkv_t, dO, q, kv_t, o, l, split, r, H, KV);
      const auto t2 = clock::now();
      t[size_t(r)].cpu.push_back(cpu_ms() - c0);
      t[size_t(r)].fwd.push_back(ms(t0, t1));
      t[size_t(r)].bwd.push_back(ms(t1, t2));
      t[size_t(r)].total.push_back(ms(t0, t2));
    }
  return t;
}

double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

// One line of per-rank times (each the fastest of the repeats) and their max/mean.
double report(const char* what, const std::vector<RankTimes>& t, std::vector<double> RankTimes::*field) {
  double mx = 0, sum = 0;
  std::string per;
  for (const RankTimes& r : t) {
    const double m = min_of(r.*field);
    mx = std::max(mx, m);
    sum += m;
    char buf[32];
    std::snprintf(buf, sizeof buf, " %7.1f", m);
    per += buf;
  }
  const double mean = sum / double(t.size());
  std::printf("    %-8s ms per rank:%s  max/mean %.3f\n", what, per.c_str(), mx / mean);
  return mean;
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
  std::printf("cp attention, CPU f32: B 1, T %lld, H %d, KV %d, D %lld, fastest of %d per rank\n",
              (long long)T, H, KV, (long long)D, repeats);
  const double one = time_one_rank(T, 1, H, KV, D, repeats);
  std::printf("one rank (flash pair, whole sequence): %.0f ms\n", one);
  for (int c : {2, 4}) {
    if (only != 0 && c != only) continue;
    for (bool head_tail : {true, false}) {
      const ContextSplit split = ContextSplit::of(T, c, head_tail);
      std::string work;
      for (int r = 0; r < c; ++r) {
        const CpAttentionWork w = cp_attention_work(split, r);
        char buf[64];
        std::snprintf(buf, sizeof buf, " %lld/%lld", (long long)w.computed_pairs, (long long)w.causal_pairs);
        work += buf;
      }
      std::printf("c %d %s (expected max/mean %.3f); computed/causal (query, key) pairs per head:%s\n", c,
                  head_tail ? "head-tail" : "contiguous", head_tail ? 1.0 : double(2 * c - 1) / c, work.c_str());
      const std::vector<RankTimes> t = time_ranks(split, 1, H, KV, D, repeats);
      report("forward", t, &RankTimes::fwd);
      report("backward", t, &RankTimes::bwd);
      const double mean = report("total", t, &RankTimes::total);
      report("cpu", t, &RankTimes::cpu);
      std::printf("    (per-rank mean x c) / one rank: %.2f\n", mean * c / one);
    }
  }
  return 0;
}
