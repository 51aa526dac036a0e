// kernels/cpu/attention_rows.h: the row helpers of the row-at-a-time CPU
// attention loops, shared by the flash pair (attention.cc) and the
// context-parallel pair (cp_attention.cc) so that both compute the same
// values the same way (private to kernels/cpu).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/common.h"

namespace xirang::cpu::attention_rows {

template <class T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <class T>
inline void axpy(T alpha, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// n values widened to the compute type (a copy for F32/F64), and back
// (rounded once for 16-bit).
template <class S>
inline void widen(const S* src, compute_t<S>* dst, int64_t n) {
  if constexpr (is_16bit_v<S>) load_row(src, dst, n);
  else std::copy(src, src + n, dst);
}
template <class S>
inline void narrow(const compute_t<S>* src, S* dst, int64_t n) {
  if constexpr (is_16bit_v<S>) store_row(src, dst, n);
  else std::copy(src, src + n, dst);
}

}  // namespace xirang::cpu::attention_rows
