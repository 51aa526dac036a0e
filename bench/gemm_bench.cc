// The CPU GEMM paths side by side (kernels/cpu/gemm.h): OpenBLAS and oneDNN
// on the products a linear layer runs (forward y = x w^T, input gradient
// dx = dy w, weight gradient dw += dy^T x), alternating in one run, with the
// ratio per product and over all of them (time-weighted). The default shapes
// are those of issue 18's two rows: gpt2_124m at 256 tokens and the 4-layer
// d_model 256 model at 2048 tokens, vocabulary head included.
//
//   OMP_NUM_THREADS=2 build/bin/gemm_bench [--pairs 5] [--shapes TOKENSxINxOUT,...]
//   OPENBLAS_CORETYPE=Haswell OMP_NUM_THREADS=2 build/bin/gemm_bench   # OpenBLAS held to AVX2
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/rng.h"
#include "kernels/cpu/gemm.h"

using namespace xirang;
using cpu::GemmPath;

namespace {

struct Shape {
  long tokens, in, out;
};

std::vector<Shape> parse_shapes(const std::string& s) {
  std::vector<Shape> r;
  size_t at = 0;
  while (at < s.size()) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    Shape sh{};
    if (std::sscanf(s.substr(at, end - at).c_str(), "%ldx%ldx%ld", &sh.tokens, &sh.in, &sh.out) != 3 ||
        sh.tokens <= 0 || sh.in <= 0 || sh.out <= 0) {
      std::fprintf(stderr, "gemm_bench: --shapes item '%s' is not TOKENSxINxOUT with positive sizes\n",
                   s.substr(at, end - at).c_str());
      std::exit(2);
    }
    r.push_back(sh);
    at = end + 1;
  }
  return r;
}

double seconds_of(GemmPath::Kind p, int which, const Shape& s, std::vector<float>& x, std::vector<float>& w,
                  std::vector<float>& y, std::vector<float>& dx, std::vector<float>& dw) {
  auto t0 = std::chrono::steady_clock::now();
  if (which == 0) cpu::sgemm_on(p, false, true, s.tokens, s.out, s.in, 1.f, x.data(), s.in, w.data(), s.in, 0.f, y.data(), s.out);
  if (which == 1) cpu::sgemm_on(p, false, false, s.tokens, s.in, s.out, 1.f, y.data(), s.out, w.data(), s.in, 0.f, dx.data(), s.in);
  if (which == 2) cpu::sgemm_on(p, true, false, s.out, s.in, s.tokens, 1.f, y.data(), s.out, x.data(), s.in, 1.f, dw.data(), s.in);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int pairs = 5;
  std::string shapes = "256x768x2304,256x768x768,256x768x3072,256x3072x768,256x768x50257,"
                       "2048x256x768,2048x256x256,2048x256x1024,2048x1024x256,2048x256x50257";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--pairs" && i + 1 < argc) pairs = std::atoi(argv[++i]);
    else if (a == "--shapes" && i + 1 < argc) shapes = argv[++i];
    else {
      std::fprintf(stderr, "usage: gemm_bench [--pairs N] [--shapes TOKENSxINxOUT,...]\n");
      return 2;
    }
  }
  if (!cpu::have_onednn()) {
    std::printf("gemm_bench: this build has no oneDNN: one path only, nothing to compare\n");
    return 77;
  }
  std::printf("auto chooses: %s (%s)\n", cpu::gemm_path().name, cpu::gemm_path().why.c_str());
  std::printf("| tokens x in x out | product | OpenBLAS GFLOP/s | oneDNN GFLOP/s | oneDNN / OpenBLAS |\n|---|---|---|---|---|\n");
  const char* names[3] = {"forward", "input grad", "weight grad"};
  double total[2] = {0, 0};
  for (const Shape& s : parse_shapes(shapes)) {
    std::vector<float> x(s.tokens * s.in), w(s.out * s.in), y(s.tokens * s.out), dx(s.tokens * s.in), dw(s.out * s.in);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(rng_normal(1, 0, i));
    for (size_t i = 0; i < w.size(); ++i) w[i] = float(rng_normal(2, 0, i)) * 0.02f;
    for (size_t i = 0; i < y.size(); ++i) y[i] = float(rng_normal(3, 0, i));
    const double flops = 2.0 * s.tokens * s.in * s.out;
    for (int which = 0; which < 3; ++which) {
      std::vector<double> t[2];
      seconds_of(GemmPath::OpenBlas, which, s, x, w, y, dx, dw);  // warm-up: pages, thread start, JIT
      seconds_of(GemmPath::OneDnn, which, s, x, w, y, dx, dw);
      for (int p = 0; p < pairs; ++p)
        for (int k = 0; k < 2; ++k) {  // alternate which path goes first
          const int first = (p + k) % 2;
          t[first].push_back(seconds_of(first ? GemmPath::OneDnn : GemmPath::OpenBlas, which, s, x, w, y, dx, dw));
        }
      const double ob = bench::median(t[0]), dn = bench::median(t[1]);
      total[0] += ob, total[1] += dn;
      std::printf("| %ld x %ld x %ld | %s | %.1f | %.1f | %.3f |\n", s.tokens, s.in, s.out, names[which],
                  flops / ob / 1e9, flops / dn / 1e9, ob / dn);
    }
  }
  std::printf("all products (time-weighted): oneDNN / OpenBLAS = %.3f\n", total[0] / total[1]);
  return 0;
}
