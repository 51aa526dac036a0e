// kernels/cpu/gemm_16bit.h: the matrix product behind matmul and the linear
// layer for BF16/F16 storage (private to kernels/cpu; tests reach it to
// exercise the tiling with small tiles).
//
//   gemm_16bit<bf16, float>(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, ldc, nullptr,
//                           GemmTiles::for_shape(M, N, K));
#pragma once

#include <algorithm>
#include <type_traits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"

namespace xirang::cpu {

// Tile sizes of one product: rows of C, columns of C, and the K range summed
// per sgemm call.
struct GemmTiles {
  int64_t m, n, k;

  // Per-operand scratch budget, in floats (16 MB): large enough that a GPT-2
  // weight or activation block converts once per call, small enough that the
  // vocabulary head is tiled instead of widened whole.
  static constexpr int64_t kBudget = int64_t(1) << 22;

  static GemmTiles for_shape(int64_t M, int64_t N, int64_t K) {
    GemmTiles t;
    t.k = K <= 4096 ? std::max<int64_t>(K, 1) : 2048;
    t.n = std::max<int64_t>(1, std::min(N, std::max<int64_t>(256, kBudget / t.k)));
    t.m = std::max<int64_t>(1, std::min(M, std::max<int64_t>(64, kBudget / (t.k + t.n))));
    return t;
  }
};

// Rows [r0, r1) x columns [c0, c1) of a row-major 16-bit matrix (leading
// dimension ld) widened into a dense float tile. Parallel over rows; the
// caller is outside any OpenMP region and BLAS is not running.
template <class S>
void load_tile(const S* src, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* dst) {
  const int64_t w = c1 - c0;
#pragma omp parallel for schedule(static)
  for (int64_t r = r0; r < r1; ++r) load_row(src + r * ld + c0, dst + (r - r0) * w, w);
}

// C (M, N) of type O = alpha op(A) op(B) + beta C [+ bias (N) on every row],
// for A, B of 16-bit type S and O = S or float. The product is tiled over M,
// N and K; every tile of C is summed in float (in place when O is float, in
// scratch otherwise) over all of K and rounded once when stored. A converted
// tile is reused while its position is unchanged; with one K tile the loops
// run in the order that converts fewer elements (the vocabulary head's
// forward: each block of the weight once, the small activation per block).
template <class S, class O>
void gemm_16bit(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const S* A, int64_t lda, const S* B,
                int64_t ldb, float beta, O* C, int64_t ldc, const S* bias, GemmTiles tiles) {
  const int64_t MB = tiles.m, NB = tiles.n, KB = tiles.k;
  float* ta_buf = thread_scratch<float, kScratchA>(size_t(MB * KB));
  float* tb_buf = thread_scratch<float, kScratchB>(size_t(NB * KB));
  float* tc_buf = std::is_same_v<O, float> ? nullptr : thread_scratch<float, kScratchC>(size_t(MB * NB));
  float* bias_f = nullptr;
  if (bias) {
    bias_f = thread_scratch<float, kScratchReduce>(size_t(N));
    load_row(bias, bias_f, N);
  }
  int64_t a_at[2] = {-1, -1}, b_at[2] = {-1, -1};  // (row, k) origin of the converted tiles
  // One tile of C: [m0, m1) x [n0, n1), summed over all of K.
  auto tile = [&](int64_t m0, int64_t n0) {
    const int64_t m1 = std::min(M, m0 + MB), n1 = std::min(N, n0 + NB);
    float* ct;
    int64_t ldct;
    float beta0 = beta;  // beta of the first K tile; later tiles add (beta 1)
    if constexpr (std::is_same_v<O, float>) {
      ct = C + m0 * ldc + n0, ldct = ldc;
    } else {
      ct = tc_buf, ldct = n1 - n0;
      if (beta != 0.0f) load_tile(C, ldc, m0, m1, n0, n1, ct);
    }
    if (bias_f) {
#pragma omp parallel for schedule(static)
      for (int64_t i = m0; i < m1; ++i)
        for (int64_t j = n0; j < n1; ++j) ct[(i - m0) * ldct + (j - n0)] = bias_f[j];
      beta0 = 1.0f;
    }
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = std::min(K, k0 + KB), kb = k1 - k0;
      // op(A) rows [m0, m1) x k [k0, k1): stored A[m, k], or A[k, m] transposed.
      if (a_at[0] != m0 || a_at[1] != k0) {
        if (ta) load_tile(A, lda, k0, k1, m0, m1, ta_buf);
        else load_tile(A, lda, m0, m1, k0, k1, ta_buf);
        a_at[0] = m0, a_at[1] = k0;
      }
      if (b_at[0] != n0 || b_at[1] != k0) {
        if (tb) load_tile(B, ldb, n0, n1, k0, k1, tb_buf);
        else load_tile(B, ldb, k0, k1, n0, n1, tb_buf);
        b_at[0] = n0, b_at[1] = k0;
      }
      sgemm(ta, tb, m1 - m0, n1 - n0, kb, alpha, ta_buf, ta ? m1 - m0 : kb, tb_buf, tb ? kb : n1 - n0,
            k0 == 0 ? beta0 : 1.0f, ct, ldct);
    }
    if (K == 0)  // an empty product: C = beta0 C, as BLAS defines it
      for (int64_t i = 0; i < m1 - m0; ++i)
        for (int64_t j = 0; j < n1 - n0; ++j) ct[i * ldct + j] = beta0 == 0.0f ? 0.0f : beta0 * ct[i * ldct + j];
    if constexpr (!std::is_same_v<O, float>) {
#pragma omp parallel for schedule(static)
      for (int64_t i = m0; i < m1; ++i) store_row(ct + (i - m0) * ldct, C + i * ldc + n0, n1 - n0);
    }
  };
  // With one K tile a converted tile is reused while the loop runs inside
  // it: the outer loop's operand converts once, the inner one's once per
  // outer step. The order that converts fewer elements goes (the result is
  // the same either way: each tile of C is summed alone).
  const int64_t m_blocks = (M + MB - 1) / MB, n_blocks = (N + NB - 1) / NB;
  const bool n_outer = KB >= K && double(N) + double(M) * double(n_blocks) < double(M) + double(N) * double(m_blocks);
  if (n_outer) {
    for (int64_t n0 = 0; n0 < N; n0 += NB)
      for (int64_t m0 = 0; m0 < M; m0 += MB) tile(m0, n0);
  } else {
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      for (int64_t n0 = 0; n0 < N; n0 += NB) tile(m0, n0);
  }
}

// gemm_16bit's product on the fastest path this process has: oneDNN's bf16
// matmul for bf16 operands where it runs (gemm.h, bf16_gemm), else the
// tiles above. The ops call this; tests of the tiling call gemm_16bit.
template <class S, class O>
void gemm_16bit_best(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const S* A, int64_t lda,
                     const S* B, int64_t ldb, float beta, O* C, int64_t ldc, const S* bias) {
  if constexpr (std::is_same_v<S, bf16> && (std::is_same_v<O, bf16> || std::is_same_v<O, float>))
    if (bf16_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, std::is_same_v<O, bf16>, ldc, bias)) return;
  gemm_16bit<S, O>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias, GemmTiles::for_shape(M, N, K));
}

}  // namespace xirang::cpu
