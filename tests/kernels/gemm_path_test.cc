// Tests for kernels/cpu/gemm.h: both CPU GEMM paths against a float64
// reference, the oneDNN path's independence from the thread count (its own
// threading would split K for some shapes), and the choice of path.
//
// Tolerance: an fp32 product of K terms of N(0,1) operands is off by about
// sqrt(K) * 2^-24 * |terms|; 1e-5 relative to max(1, max|ref|) holds K up to
// a few thousand with a wide margin, while a wrong transpose, offset or
// block is off by O(1).
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

using cpu::GemmPath;

std::vector<GemmPath::Kind> paths() {
  std::vector<GemmPath::Kind> p = {GemmPath::OpenBlas};
  if (cpu::have_onednn()) p.push_back(GemmPath::OneDnn);
  return p;
}

std::vector<float> to_f32(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }

// C = alpha op(A) op(B) + beta C on `path`, checked element by element.
void check_product(GemmPath::Kind path, int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha, float beta,
                   uint64_t seed) {
  SCOPED_TRACE(testing::Message() << (path == GemmPath::OneDnn ? "onednn" : "openblas") << " M " << M << " N " << N
                                  << " K " << K << " ta " << ta << " tb " << tb << " beta " << beta);
  const auto a = to_f32(randn(M * K, seed)), b = to_f32(randn(K * N, seed + 1));
  auto c = to_f32(randn(M * N, seed + 2));
  if (beta == 0.0f) c.assign(c.size(), std::nanf(""));  // beta 0 must not read C
  std::vector<double> ref(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(ta ? a[k * M + i] : a[i * K + k]) * double(tb ? b[j * K + k] : b[k * N + j]);
      ref[i * N + j] = alpha * s + (beta == 0.0f ? 0.0 : beta * double(c[i * N + j]));
    }
  cpu::sgemm_on(path, ta, tb, M, N, K, alpha, a.data(), ta ? M : K, b.data(), tb ? K : N, beta, c.data(), N);
  double scale = 1;
  for (double r : ref) scale = std::max(scale, std::abs(r));
  for (int64_t i = 0; i < M * N; ++i)
    ASSERT_NEAR(c[i], ref[i], 1e-5 * scale) << "element " << i / N << ", " << i % N;
}

TEST(GemmPath, BothPathsMatchAFloat64Reference) {
  uint64_t seed = 11;
  for (auto path : paths())
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        check_product(path, 37, 45, 29, ta, tb, 1.0f, 0.0f, seed++);
        check_product(path, 300, 170, 64, ta, tb, 0.5f, 1.0f, seed++);  // several blocks on oneDNN
        check_product(path, 90, 700, 33, ta, tb, 1.0f, 1.0f, seed++);   // blocks of columns
      }
}

TEST(GemmPath, EmptyKScalesC) {
  for (auto path : paths()) {
    std::vector<float> c = {1, 2, 3, 4}, a(1), b(1);
    cpu::sgemm_on(path, false, false, 2, 2, 0, 1.0f, a.data(), 1, b.data(), 2, 0.5f, c.data(), 2);
    EXPECT_EQ(c, (std::vector<float>{0.5f, 1, 1.5f, 2}));
  }
}

// The same product on 1, 2 and 3 threads, from outside and from inside an
// OpenMP region, bit for bit. (2048, 256, 1024) is a shape that oneDNN's own
// threading splits over K: one whole call on 1 and on 3 threads differs.
TEST(GemmPath, OneDnnResultDoesNotDependOnTheThreadCount) {
  if (!cpu::have_onednn()) GTEST_SKIP() << "this build has no oneDNN";
  const int saved = omp_get_max_threads();
  for (auto [M, N, K] : {std::array<int64_t, 3>{2048, 256, 1024}, {256, 2304, 768}, {64, 64, 2048}, {8, 3000, 256}}) {
    SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K);
    const auto a = to_f32(randn(M * K, 5)), b = to_f32(randn(N * K, 6));
    std::vector<std::vector<float>> out;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      out.emplace_back(M * N);
      cpu::sgemm_on(GemmPath::OneDnn, false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, out.back().data(), N);
    }
    omp_set_num_threads(saved);
    std::vector<float> inside(M * N);
#pragma omp parallel num_threads(2)
#pragma omp single
    cpu::sgemm_on(GemmPath::OneDnn, false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, inside.data(), N);
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), M * N * sizeof(float))) << "1 and 2 threads";
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[2].data(), M * N * sizeof(float))) << "1 and 3 threads";
    EXPECT_EQ(0, std::memcmp(out[0].data(), inside.data(), M * N * sizeof(float))) << "inside a parallel region";
  }
}

TEST(GemmPath, ChoiceFollowsTheSettingAndRefusesUnknownOnes) {
  EXPECT_EQ(cpu::choose_gemm_path("openblas").kind, GemmPath::OpenBlas);
  const auto automatic = cpu::choose_gemm_path("");
  EXPECT_EQ(automatic.kind, cpu::choose_gemm_path("auto").kind);
  EXPECT_NE(automatic.why.find("auto: CPU: "), std::string::npos) << automatic.why;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  EXPECT_EQ(automatic.kind, cpu::have_onednn() && avx512 ? GemmPath::OneDnn : GemmPath::OpenBlas) << automatic.why;
  if (cpu::have_onednn()) EXPECT_EQ(cpu::choose_gemm_path("onednn").kind, GemmPath::OneDnn);
  try {
    cpu::choose_gemm_path("mkl");
    FAIL() << "an unknown path was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("XIRANG_CPU_GEMM='mkl' is not a GEMM path (expected auto, openblas or onednn)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace xirang::test
