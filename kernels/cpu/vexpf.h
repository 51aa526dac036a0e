// kernels/cpu/vexpf.h: e^x for eight floats at once (AVX2/FMA, the build's
// baseline), for the softmaxes of the cross-entropy and of attention, where
// the arguments are x - max <= 0 and one exp per logit or score is the
// inner loop.
//
// Accuracy: within 2 ulp of the correctly rounded e^x for x in [-87.3, 88.3]
// (tests/kernels/vexpf_test.cc checks it against libm in double). Below
// -87.3 (e^x < 1.2e-38) the result is 0, -inf included; above 88.3 it is
// e^88.3 (the softmaxes never go there); NaN stays NaN. The result depends
// on x alone, not on its lane.
//
//   __m256 e = cpu::exp8f(_mm256_sub_ps(x, mx));
#pragma once

#include <immintrin.h>

namespace xirang::cpu {

inline __m256 exp8f(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  // max/min return their second operand when either is NaN: a NaN lane stays NaN.
  __m256 v = _mm256_max_ps(lo, x);
  v = _mm256_min_ps(hi, v);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = v - n ln 2 with ln 2 split so that n * kLn2Hi is exact for |n| <= 128; |r| <= ln(2)/2.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  // e^r by its Taylor series to r^7 (truncation under 6e-9 relative), Horner.
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // 2^n, n in [-126, 127]: a normal float built from its exponent bits.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 res = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), res);
}

// Sum of the eight lanes (a fixed order: the same lanes give the same sum).
inline float hsum8f(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Largest of the eight lanes (NaN lanes are skipped).
inline float hmax8f(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace xirang::cpu
