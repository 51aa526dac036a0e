// bench/moe_grouped_bench.cc: the grouped product over experts
// (kernels/moe.h) against a loop of per-expert products through the
// ordinary matmul API (kernels/matmul.h), forward and both backward
// products, at 8 and 16 experts with ragged, skewed token counts (a few
// hot experts, one or two nearly idle: what a router produces before
// balancing settles). f32 on the CPU. One run: the two forms alternate
// rep by rep, each timed by its median, and the ratio loop / grouped is
// printed (> 1: the grouped call is faster).
//
//   build/bin/moe_grouped_bench [reps]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/bench_util.h"
#include "kernels/matmul.h"
#include "kernels/moe.h"

namespace xirang {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Per-expert row counts summing to rows: weights exp(1.2 z), z normal, so
// the largest expert gets several times the mean and the smallest a few rows.
std::vector<int32_t> skewed_offsets(int64_t E, int64_t rows, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> wts(E);
  double sum = 0;
  for (auto& x : wts) sum += x = std::exp(1.2 * dist(gen));
  std::vector<int32_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + int32_t(rows * wts[e] / sum);
  off[E] = int32_t(rows);  // the rounding remainder to the last expert
  return off;
}

struct Problem {
  int64_t E, R, in, out;
  std::vector<int32_t> off;
  std::vector<float> x, w, y, dy, dx, dw;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void grouped(const KernelContext& ctx, Problem& p) {
  Tensor off(p.off.data(), {p.E + 1}, DType::I32);
  Tensor w(p.w.data(), {p.E, p.in, p.out}, DType::F32);
  Tensor x(p.x.data(), {p.R, p.in}, DType::F32);
  grouped_matmul_forward(ctx, Tensor(p.y.data(), {p.R, p.out}, DType::F32), x, w, off);
  grouped_matmul_backward(ctx, Tensor(p.dx.data(), {p.R, p.in}, DType::F32), Tensor(p.dw.data(), {p.E, p.in, p.out}, DType::F32),
                          Tensor(p.dy.data(), {p.R, p.out}, DType::F32), x, w, off, GradMode::Overwrite);
}

void loop(const KernelContext& ctx, Problem& p) {
  for (int64_t e = 0; e < p.E; ++e) {
    const int64_t r0 = p.off[e], M = p.off[e + 1] - r0;
    if (M == 0) continue;
    Tensor x(p.x.data() + r0 * p.in, {M, p.in}, DType::F32), dx(p.dx.data() + r0 * p.in, {M, p.in}, DType::F32);
    Tensor y(p.y.data() + r0 * p.out, {M, p.out}, DType::F32), dy(p.dy.data() + r0 * p.out, {M, p.out}, DType::F32);
    Tensor w(p.w.data() + e * p.in * p.out, {p.in, p.out}, DType::F32);
    Tensor dw(p.dw.data() + e * p.in * p.out, {p.in, p.out}, DType::F32);
    matmul(ctx, y, x, w, false, false);
    matmul(ctx, dx, dy, w, false, true);
    matmul(ctx, dw, x, dy, true, false, 1.0, 1.0);
  }
}

void run(int64_t E, int64_t k, int reps) {
  // 4096 tokens of width 1024 into fine-grained experts of width 512.
  Problem p{E, 4096 * k, 1024, 512, {}, {}, {}, {}, {}, {}, {}};
  p.off = skewed_offsets(E, p.R, 9000 + E);
  p.x = random_floats(p.R * p.in, 1);
  p.w = random_floats(E * p.in * p.out, 2);
  p.dy = random_floats(p.R * p.out, 3);
  p.y.resize(p.R * p.out);
  p.dx.resize(p.R * p.in);
  p.dw.assign(E * p.in * p.out, 0.0f);
  KernelContext ctx;
  grouped(ctx, p);  // warm-up: thread pools, page faults
  loop(ctx, p);
  std::vector<double> tg, tl;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    grouped(ctx, p);
    tg.push_back(seconds_since(t0));
    t0 = Clock::now();
    loop(ctx, p);
    tl.push_back(seconds_since(t0));
  }
  int32_t lo = p.R, hi = 0;
  for (int64_t e = 0; e < E; ++e) lo = std::min(lo, p.off[e + 1] - p.off[e]), hi = std::max(hi, p.off[e + 1] - p.off[e]);
  const double g = bench::median(tg), l = bench::median(tl);
  const double flops = 6.0 * double(p.R) * double(p.in) * double(p.out);
  std::printf("experts %2ld top-%ld rows %ld (per expert %d..%d)  grouped %.2f ms (%.1f GFLOP/s)  loop %.2f ms  "
              "loop/grouped %.3f\n",
              long(E), long(k), long(p.R), lo, hi, g * 1e3, flops / g * 1e-9, l * 1e3, l / g);
}

}  // namespace
}  // namespace xirang

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  if (reps < 1 || argc > 2) {
    std::fprintf(stderr, "usage: moe_grouped_bench [REPS >= 1]\n");
    return 2;
  }
  std::printf("moe_grouped_bench: f32, forward + dX + dW, CPU GEMM path %s, %d reps (median)\n",
              xirang::cpu_gemm_path().c_str(), reps);
  xirang::run(8, 2, reps);
  xirang::run(16, 4, reps);
  return 0;
}
