// kernels/cpu/gemm.h: the single-precision matrix product every CPU kernel
// uses (private to kernels/cpu), on the path chosen once per process from
// what the CPU offers.
//
//   cpu::sgemm(false, true, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N);   // y = x w^T
//   cpu::gemm_path().name                                             // "onednn", "openblas"
//
// Paths:
//   openblas  OpenBLAS's sgemm (its OpenMP build: the same thread pool as the
//             other kernels), with the kernels OpenBLAS picks for the core it
//             detects (OPENBLAS_CORETYPE may hold it to AVX2). Its threaded
//             driver partitions by the thread count and its results change
//             with it, so it gets the same blocks as onednn below.
//   onednn    oneDNN's sgemm, whose kernels are generated at run time for the
//             instruction set the CPU has (AVX-512 included). Its own
//             threading may split K across threads, which would make results
//             depend on the thread count, so the output is cut into row or
//             column blocks by shape alone and each block is one
//             single-threaded call inside one OpenMP loop.
// `auto` (the default) takes onednn where the build has it and the CPU has
// AVX-512 (F, BW, DQ, VL), openblas otherwise. XIRANG_CPU_GEMM=openblas |
// onednn | auto overrides it; an unknown value or onednn in a build without
// it is a usage error naming the variable.
//
// Either way a product's result depends on its shape and operands only, never
// on the thread count.
#pragma once

#include <cstdint>
#include <string>

namespace xirang::cpu {

struct GemmPath {
  enum Kind { OpenBlas, OneDnn } kind;
  const char* name;  // "openblas", "onednn"
  std::string why;   // one line: how it was chosen, and what the CPU offers
};

// The path of this process, decided on the first call (thread-safe) from
// XIRANG_CPU_GEMM.
const GemmPath& gemm_path();

// The path a setting of XIRANG_CPU_GEMM ("" means auto) chooses on this CPU.
GemmPath choose_gemm_path(const std::string& setting);

// Replaces the process's path as if XIRANG_CPU_GEMM were `setting`; only
// while no product runs (tests pin a path before they train).
void set_gemm_path(const std::string& setting);

// Row-major C (M, N) = alpha op(A) op(B) + beta C, op(A) (M, K), op(B) (K, N);
// beta 0 ignores C's contents. Callable inside an OpenMP region (the product
// then runs on the calling thread).
void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// F64: OpenBLAS's dgemm (float64 references and gradient checks; no other path).
void dgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
           const double* B, int64_t ldb, double beta, double* C, int64_t ldc);

// One name for both, so kernels templated on float or double call one product.
inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
                 const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  dgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// The same product on a path named explicitly (benchmarks and tests compare
// the paths); refuses onednn in a build without it.
void sgemm_on(GemmPath::Kind path, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// C (M, N), float or bf16 (c_bf16), = alpha op(A) op(B) [+ bias (N)] + beta C
// for bf16 A, B and bias, summed in float and rounded once, on oneDNN's
// bf16 matmul with the CPU's BF16 dot products, in blocks fixed by shape
// (thread-count independent). False, with nothing done, where this process's
// path is not onednn, the CPU has no AVX512_BF16 kernel in oneDNN, or bias
// comes with a nonzero beta: the caller then widens tiles to fp32
// (gemm_16bit.h).
bool bf16_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
               const void* B, int64_t ldb, float beta, void* C, bool c_bf16, int64_t ldc, const void* bias);

// Whether this build has the onednn path.
bool have_onednn();

}  // namespace xirang::cpu
