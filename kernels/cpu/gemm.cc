// The CPU's single-precision matrix product on OpenBLAS or oneDNN (see gemm.h).
#include "kernels/cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#ifdef XIRANG_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

#include "core/error.h"

extern "C" char* openblas_get_corename(void);

namespace xirang::cpu {

namespace {

bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

std::string isa_words() {
  std::string s = cpu_has_avx512() ? "AVX-512" : __builtin_cpu_supports("avx2") ? "AVX2" : "no AVX2";
  if (__builtin_cpu_supports("avx512bf16")) s += " with BF16";
  return s;
}

}  // namespace

GemmPath choose_gemm_path(const std::string& setting) {
  const std::string want = setting.empty() ? "auto" : setting;
  const std::string core = std::string("OpenBLAS core ") + openblas_get_corename();
  const std::string cpu = "CPU: " + isa_words();
  if (want == "openblas") return {GemmPath::OpenBlas, "openblas", "XIRANG_CPU_GEMM=openblas; " + cpu + "; " + core};
  if (want == "onednn") {
    if (!have_onednn())
      fail(ErrorKind::Usage, "XIRANG_CPU_GEMM=onednn, but this build has no oneDNN (install libdnnl-dev and rebuild)");
    return {GemmPath::OneDnn, "onednn", "XIRANG_CPU_GEMM=onednn; " + cpu};
  }
  if (want != "auto")
    fail(ErrorKind::Usage, "XIRANG_CPU_GEMM='", want, "' is not a GEMM path (expected auto, openblas or onednn)");
  if (have_onednn() && cpu_has_avx512())
    return {GemmPath::OneDnn, "onednn", "auto: " + cpu + ", kernels generated for it by oneDNN"};
  return {GemmPath::OpenBlas, "openblas", "auto: " + cpu + (have_onednn() ? "" : ", no oneDNN in this build") +
                                              "; " + core};
}

namespace {

void openblas_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B,
              ldb, beta, C, ldc);
}

#ifdef XIRANG_HAVE_ONEDNN
void onednn_call(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (st != dnnl_success)
    fail(ErrorKind::Library, "sgemm: oneDNN refused a (", M, ", ", N, ", ", K, ") product with status ", int(st));
}

// The number of blocks is the largest of kBlockCounts that leaves each block
// at least kMinBlockWidth rows or columns (so that the operand every block
// shares is packed again seldom) and kFlopsPerBlock of work (about 0.3 ms of
// one core). The counts divide evenly among 1, 2, 3, 4 or 6 threads.
constexpr double kFlopsPerBlock = 32e6;
constexpr int64_t kMinBlockWidth = 128;
constexpr int64_t kBlockCounts[] = {48, 24, 16, 12, 8, 6, 4, 2, 1};

void onednn_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const double flops = 2.0 * double(M) * double(N) * double(K);
  const bool by_rows = M >= N;
  const int64_t D = by_rows ? M : N;
  int64_t count = 1;
  for (int64_t c : kBlockCounts)
    if (D / c >= kMinBlockWidth && flops / double(c) >= kFlopsPerBlock) {
      count = c;
      break;
    }
  const int64_t width = (D + count - 1) / count, blocks = (D + width - 1) / width;
  auto block = [&](int64_t b) {
    const int64_t s = b * width, w = std::min(D, s + width) - s;
    if (by_rows)
      onednn_call(ta, tb, w, N, K, alpha, ta ? A + s : A + s * lda, lda, B, ldb, beta, C + s * ldc, ldc);
    else
      onednn_call(ta, tb, M, w, K, alpha, A, lda, tb ? B + s * ldb : B + s, ldb, beta, C + s, ldc);
  };
  if (omp_in_parallel()) {  // oneDNN runs on this thread alone
    for (int64_t b = 0; b < blocks; ++b) block(b);
    return;
  }
  if (blocks == 1) {  // one block: one thread, so that oneDNN cannot split K
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    block(0);
    omp_set_num_threads(threads);
    return;
  }
  // Each block runs inside the region, where oneDNN plans for one thread.
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) block(b);
}
#endif

}  // namespace

bool have_onednn() {
#ifdef XIRANG_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

namespace {
GemmPath& current_path() {
  static GemmPath path = [] {
    const char* env = std::getenv("XIRANG_CPU_GEMM");
    return choose_gemm_path(env ? env : "");
  }();
  return path;
}
}  // namespace

const GemmPath& gemm_path() { return current_path(); }

void set_gemm_path(const std::string& setting) { current_path() = choose_gemm_path(setting); }

void sgemm_on(GemmPath::Kind path, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // an empty sum: C = beta C as BLAS defines it (OpenBLAS returns early instead)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
#ifdef XIRANG_HAVE_ONEDNN
  if (path == GemmPath::OneDnn) return onednn_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
  if (path == GemmPath::OneDnn) fail(ErrorKind::Usage, "sgemm: this build has no oneDNN");
#endif
  openblas_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm_on(gemm_path().kind, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace xirang::cpu
