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
#include <tuple>
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
// OpenMP region, bit for bit, on each path. (2048, 256, 1024) is a shape
// that oneDNN's own threading splits over K: one whole call on 1 and on 3
// threads differs; OpenBLAS's threaded driver changes its partition (and so
// some of its results) with the thread count too.
void expect_thread_count_independent(GemmPath::Kind path) {
  const int saved = omp_get_max_threads();
  for (auto [M, N, K] : {std::array<int64_t, 3>{2048, 256, 1024}, {256, 2304, 768}, {64, 64, 2048}, {8, 3000, 256},
                         {512, 64, 64}, {64, 192, 512}}) {
    SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K);
    const auto a = to_f32(randn(M * K, 5)), b = to_f32(randn(N * K, 6));
    std::vector<std::vector<float>> out;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      out.emplace_back(M * N);
      cpu::sgemm_on(path, false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, out.back().data(), N);
    }
    omp_set_num_threads(saved);
    std::vector<float> inside(M * N);
#pragma omp parallel num_threads(2)
#pragma omp single
    cpu::sgemm_on(path, false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, inside.data(), N);
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), M * N * sizeof(float))) << "1 and 2 threads";
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[2].data(), M * N * sizeof(float))) << "1 and 3 threads";
    EXPECT_EQ(0, std::memcmp(out[0].data(), inside.data(), M * N * sizeof(float))) << "inside a parallel region";
  }
}

TEST(GemmPath, OneDnnResultDoesNotDependOnTheThreadCount) {
  if (!cpu::have_onednn()) GTEST_SKIP() << "this build has no oneDNN";
  expect_thread_count_independent(GemmPath::OneDnn);
}

TEST(GemmPath, OpenBlasResultDoesNotDependOnTheThreadCount) {
  expect_thread_count_independent(GemmPath::OpenBlas);
}

TEST(GemmPath, ChoiceFollowsTheSettingAndRefusesUnknownOnes) {
  EXPECT_EQ(cpu::choose_gemm_path("openblas").kind, GemmPath::OpenBlas);
  const auto automatic = cpu::choose_gemm_path("");
  EXPECT_EQ(automatic.kind, cpu::choose_gemm_path("auto").kind);
  EXPECT_NE(automatic.why.find("auto: CPU: "), std::string::npos) << automatic.why;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  EXPECT_EQ(automatic.kind, cpu::have_onednn() && avx512 ? GemmPath::OneDnn : GemmPath::OpenBlas) << automatic.why;
  if (cpu::have_onednn()) {
    EXPECT_EQ(cpu::choose_gemm_path("onednn").kind, GemmPath::OneDnn);
  }
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

namespace xirang::test {
namespace {

// bf16 operands on oneDNN's bf16 matmul (where this CPU has it): against a
// float64 reference of the same bf16 values; outputs in float within fp32
// summation error, outputs in bf16 within one bf16 rounding (2^-8 relative
// to the scale, 2x margin). Shapes cut into several row and column blocks,
// with and without bias, beta 0 and 1, all transposes.
bool check_bf16(int64_t M, int64_t N, int64_t K, bool ta, bool tb, bool c_bf16, float beta, bool with_bias,
                uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " ta " << ta << " tb " << tb
                                  << " c_bf16 " << c_bf16 << " beta " << beta << " bias " << with_bias);
  auto a = cast_vec<bf16>(randn(M * K, seed)), b = cast_vec<bf16>(randn(K * N, seed + 1));
  auto bias = cast_vec<bf16>(randn(N, seed + 2));
  const Vec c0 = randn(M * N, seed + 3);
  std::vector<float> cf(c0.begin(), c0.end());
  auto cb = cast_vec<bf16>(c0);
  const std::vector<float> cf_before = cf;
  const std::vector<bf16> cb_before = cb;
  void* C = c_bf16 ? static_cast<void*>(cb.data()) : static_cast<void*>(cf.data());
  if (!cpu::bf16_gemm(ta, tb, M, N, K, 1.0f, a.data(), ta ? M : K, b.data(), tb ? K : N, beta, C, c_bf16, N,
                      with_bias ? bias.data() : nullptr))
    return false;  // this shape converts to fp32 instead (gemm_16bit.h, tested there)
  double scale = 1;
  std::vector<double> ref(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = with_bias ? double(bf16_to_float(bias[j])) : 0.0;
      for (int64_t k = 0; k < K; ++k)
        s += double(bf16_to_float(ta ? a[k * M + i] : a[i * K + k])) * double(bf16_to_float(tb ? b[j * K + k] : b[k * N + j]));
      if (beta != 0.0f)
        s += beta * (c_bf16 ? double(bf16_to_float(cb_before[i * N + j])) : double(cf_before[i * N + j]));
      ref[i * N + j] = s;
      scale = std::max(scale, std::abs(s));
    }
  const double tol = c_bf16 ? 2.0 / 256 : 1e-5;
  for (int64_t i = 0; i < M * N; ++i) {
    const double got = c_bf16 ? double(bf16_to_float(cb[i])) : double(cf[i]);
    EXPECT_NEAR(got, ref[i], tol * scale) << "element " << i / N << ", " << i % N;
    if (std::abs(got - ref[i]) > tol * scale) break;
  }
  return true;
}

TEST(GemmPath, Bf16MatmulMatchesAFloat64Reference) {
  uint64_t seed = 101;
  int ran = 0;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      ran += check_bf16(256, 1100, 96, ta, tb, true, 0.0f, true, seed++);    // column blocks, bias, bf16 out
      ran += check_bf16(700, 130, 300, ta, tb, false, 1.0f, false, seed++);  // row blocks, f32 out accumulated
      ran += check_bf16(200, 900, 256, ta, tb, false, 1.0f, false, seed++);  // column blocks, f32 out accumulated
      ran += check_bf16(33, 45, 29, ta, tb, true, 0.0f, false, seed++);      // one block
    }
  ran += check_bf16(256, 2304, 768, false, true, true, 0.0f, true, seed++);  // GPT-2's qkv projection
  ran += check_bf16(64, 12000, 768, false, true, true, 0.0f, false, seed++);  // a vocabulary head
  ran += check_bf16(64, 768, 12000, false, false, true, 0.0f, false, seed++);
  if (ran == 0) GTEST_SKIP() << "no oneDNN bf16 matmul on this CPU or path (" << cpu::gemm_path().why << ")";
  EXPECT_GE(ran, 10) << "most shapes should run on oneDNN where it has a bf16 kernel";
}

// The same bf16 products on 1, 2 and 3 threads, bit for bit: blocks fixed by
// shape, each on one thread with primitives of its own.
TEST(GemmPath, Bf16MatmulDoesNotDependOnTheThreadCount) {
  const int saved = omp_get_max_threads();
  int ran = 0;
  for (auto [M, N, K, c_bf16] : {std::tuple<int64_t, int64_t, int64_t, bool>{256, 2304, 768, true},
                                 {2048, 256, 1024, false}, {64, 12000, 256, true}}) {
    SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K);
    const auto a = cast_vec<bf16>(randn(M * K, 7)), b = cast_vec<bf16>(randn(N * K, 8));
    const auto bias = cast_vec<bf16>(randn(N, 9));
    const size_t bytes = size_t(M * N) * (c_bf16 ? 2 : 4);
    std::vector<std::vector<char>> out;
    bool ok = true;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      out.emplace_back(bytes);
      ok = ok && cpu::bf16_gemm(false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, out.back().data(), c_bf16,
                                N, c_bf16 ? bias.data() : nullptr);
    }
    omp_set_num_threads(saved);
    if (!ok) continue;
    ++ran;
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), bytes)) << "1 and 2 threads";
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[2].data(), bytes)) << "1 and 3 threads";
  }
  if (ran == 0) GTEST_SKIP() << "no oneDNN bf16 matmul on this CPU or path (" << cpu::gemm_path().why << ")";
}

}  // namespace
}  // namespace xirang::test
