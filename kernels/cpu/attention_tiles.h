// kernels/cpu/attention_tiles.h: the blocked attention paths' shared pieces
// (private to kernels/cpu): the AVX2/FMA register-tile product gemm16, row
// gathering and transposition, and the masked softmax row passes. Used by
// attention_blocked.cc (one rank) and cp_attention_blocked.cc (context
// parallel), so both run the same arithmetic. A score row's mask is given
// as the last key index i a query may see (its position in the sequence).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/vexpf.h"

namespace xirang::cpu::attention_tiles {

constexpr int64_t kQBlock = 32;
constexpr int64_t kMR = 6;

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// How a product's tile meets C: Set writes the sums, Add adds them to C,
// Chain starts the fused multiply-add chains from C's values instead of
// zero. The chains are float registers, so stopping one at a K boundary,
// storing it and going on from the stored value gives the same bits: a
// product over K cut into pieces, each piece Chain onto C (zero at first),
// equals Set over the whole K (keeps long key rows in cache, results equal).
enum class Into { Set, Add, Chain };

// C(MR x 16) (+)= A(MR x K) B(K x 16), A(r, k) = A[r rsa + k csa], B row k at B + k ldb.
// The accumulators are named registers (an array of them ends up on the stack).
template <int MR>
inline void tile(int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb, float* C,
                 int64_t ldc, Into into) {
  static_assert(MR >= 1 && MR <= 6);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (into == Into::Chain) {
    auto get = [&](int r, __m256& lo, __m256& hi) {
      lo = _mm256_loadu_ps(C + r * ldc);
      hi = _mm256_loadu_ps(C + r * ldc + 8);
    };
    get(0, c00, c01);
    if constexpr (MR > 1) get(1, c10, c11);
    if constexpr (MR > 2) get(2, c20, c21);
    if constexpr (MR > 3) get(3, c30, c31);
    if constexpr (MR > 4) get(4, c40, c41);
    if constexpr (MR > 5) get(5, c50, c51);
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    const float* a = A + k * csa;
    __m256 x = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    if constexpr (MR > 1) {
      x = _mm256_broadcast_ss(a + rsa);
      c10 = _mm256_fmadd_ps(x, b0, c10);
      c11 = _mm256_fmadd_ps(x, b1, c11);
    }
    if constexpr (MR > 2) {
      x = _mm256_broadcast_ss(a + 2 * rsa);
      c20 = _mm256_fmadd_ps(x, b0, c20);
      c21 = _mm256_fmadd_ps(x, b1, c21);
    }
    if constexpr (MR > 3) {
      x = _mm256_broadcast_ss(a + 3 * rsa);
      c30 = _mm256_fmadd_ps(x, b0, c30);
      c31 = _mm256_fmadd_ps(x, b1, c31);
    }
    if constexpr (MR > 4) {
      x = _mm256_broadcast_ss(a + 4 * rsa);
      c40 = _mm256_fmadd_ps(x, b0, c40);
      c41 = _mm256_fmadd_ps(x, b1, c41);
    }
    if constexpr (MR > 5) {
      x = _mm256_broadcast_ss(a + 5 * rsa);
      c50 = _mm256_fmadd_ps(x, b0, c50);
      c51 = _mm256_fmadd_ps(x, b1, c51);
    }
  }
  auto put = [&](int r, __m256 lo, __m256 hi) {
    float* c = C + r * ldc;
    if (into == Into::Add) {
      lo = _mm256_add_ps(_mm256_loadu_ps(c), lo);
      hi = _mm256_add_ps(_mm256_loadu_ps(c + 8), hi);
    }
    _mm256_storeu_ps(c, lo);
    _mm256_storeu_ps(c + 8, hi);
  };
  put(0, c00, c01);
  if constexpr (MR > 1) put(1, c10, c11);
  if constexpr (MR > 2) put(2, c20, c21);
  if constexpr (MR > 3) put(3, c30, c31);
  if constexpr (MR > 4) put(4, c40, c41);
  if constexpr (MR > 5) put(5, c50, c51);
}

// C(M x N) (+)= A(M x K) B(K x N) with N a multiple of 16; A(i, k) = A[i rsa + k csa]
// (rsa = lda, csa = 1 for A; rsa = 1, csa = lda for a transposed A). Each
// element of C is one chain over K whatever M and N are, so products cut
// along M or N (or, with Into::Chain, along K) keep their bits.
inline void gemm16(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
                   int64_t ldb, float* C, int64_t ldc, Into into) {
  for (int64_t j = 0; j < N; j += 16)
    for (int64_t i = 0; i < M; i += kMR) {
      const float* a = A + i * rsa;
      float* c = C + i * ldc + j;
      switch (std::min<int64_t>(kMR, M - i)) {
        case 6: tile<6>(K, a, rsa, csa, B + j, ldb, c, ldc, into); break;
        case 5: tile<5>(K, a, rsa, csa, B + j, ldb, c, ldc, into); break;
        case 4: tile<4>(K, a, rsa, csa, B + j, ldb, c, ldc, into); break;
        case 3: tile<3>(K, a, rsa, csa, B + j, ldb, c, ldc, into); break;
        case 2: tile<2>(K, a, rsa, csa, B + j, ldb, c, ldc, into); break;
        default: tile<1>(K, a, rsa, csa, B + j, ldb, c, ldc, into); break;
      }
    }
}

// accumulate: Into::Add, else Into::Set.
inline void gemm16(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
                   int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm16(M, N, K, A, rsa, csa, B, ldb, C, ldc, accumulate ? Into::Add : Into::Set);
}

// T rows of a head slice (`ld` apart in src) as float rows of width Dp, zero-padded.
template <class S>
void gather_rows(const S* src, int64_t ld, int64_t T, int64_t D, int64_t Dp, float* dst) {
  for (int64_t t = 0; t < T; ++t) {
    cpu::load_row(src + t * ld, dst + t * Dp, D);
    std::fill(dst + t * Dp + D, dst + (t + 1) * Dp, 0.f);
  }
}

// Gathered rows (T, Dp) transposed into dst (Dp, Tp), columns T.. zero; in
// 8 x 8 tiles (a row of dst is Tp floats long, often a power of two: column
// at a time would keep hitting the same cache sets).
inline void transpose_rows(const float* src, int64_t T, int64_t Dp, int64_t Tp, float* dst) {
  for (int64_t t0 = 0; t0 < Tp; t0 += 8)
    for (int64_t c0 = 0; c0 < Dp; c0 += 8)
      for (int64_t c = c0; c < c0 + 8; ++c)
        for (int64_t t = t0; t < t0 + 8; ++t) dst[c * Tp + t] = t < T ? src[t * Dp + c] : 0.f;
}

// Row r of a score block (query i = i0 + r sees keys 0..i): s_j <- e^(scale s_j - shift) for j <= i, 0
// for i < j < np (np a multiple of 8). Returns the sum of the kept values,
// added as eight float lanes per 64 values and in double across them.
inline double exp_row(float* s, int64_t i, int64_t np, float scale, float shift) {
  const __m256 vs = _mm256_set1_ps(scale), vsh = _mm256_set1_ps(shift);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256d sum_lo = _mm256_setzero_pd(), sum_hi = _mm256_setzero_pd();
  __m256 acc = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < np; j += 8) {
    __m256 x = _mm256_fmsub_ps(_mm256_loadu_ps(s + j), vs, vsh);
    if (j + 8 > i + 1) {  // keys after i: masked
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(i + 1 - j)), lane);
      x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(keep));
    }
    const __m256 e = cpu::exp8f(x);
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
    if ((j & 63) == 56 || j + 8 >= np) {
      sum_lo = _mm256_add_pd(sum_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(acc)));
      sum_hi = _mm256_add_pd(sum_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1)));
      acc = _mm256_setzero_ps();
    }
  }
  alignas(32) double l[8];
  _mm256_store_pd(l, sum_lo);
  _mm256_store_pd(l + 4, sum_hi);
  double sum = 0;
  for (double v : l) sum += v;
  return sum;
}

// Largest of scale * s_j over j <= i (NaN scores are skipped here and caught by the exponentials).
inline float row_max(const float* s, int64_t i, float scale) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= i + 1; j += 8) m = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s + j), vs), m);
  float mx = cpu::hmax8f(m);
  for (; j <= i; ++j) mx = std::max(scale * s[j], mx);
  return mx;
}

}  // namespace xirang::cpu::attention_tiles
