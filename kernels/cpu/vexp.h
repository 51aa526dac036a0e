// kernels/cpu/vexp.h: e^x over arrays of doubles, four at a time (GCC
// vector extensions; AVX2/FMA, the build's baseline), for the softmax of
// the cross-entropy, where libm's scalar exp took about a third of a GPT-2
// step on the CPU (one exp per logit, twice: 2 x 50304 per token).
//
// Written here rather than taken from a library because it is one short
// function whose accuracy and inputs we control (x <= 0 in the softmax);
// tests/kernels/vexp_test.cc checks it against libm. Accuracy: within 1 ulp
// of libm's e^x for normal results; below 2^-1022 the result goes to 0
// through the subnormals (within a subnormal of libm's), over 709.78 it is
// inf, NaN stays NaN, -inf gives 0. The result depends on x alone, not on
// its position in the array.
//
//   double v[n] = {...};  exp_in_place(v, n);
#pragma once

#include <cstdint>
#include <cstring>

namespace xirang::cpu {

namespace vexp_detail {

typedef double D4 __attribute__((vector_size(32)));
typedef int64_t I4 __attribute__((vector_size(32)));

// e^v for four lanes; the same operations serve the scalar tail (a D4 with one used lane).
inline D4 exp4(D4 v) {
  constexpr double kLog2e = 0x1.71547652b82fep0;
  constexpr double kLn2Hi = 0x1.62e42fefa3800p-1;  // ln 2 split so that k * kLn2Hi is exact for |k| < 2^11
  constexpr double kLn2Lo = 0x1.ef35793c76730p-45;
  constexpr double kShifter = 0x1.8p52;            // adding it rounds to an integer kept in the low mantissa bits
  const D4 lo = D4{} - 745.2, hi = D4{} + 710.0;    // past hi the result overflows to inf
  v = v < lo ? lo : v;  // a NaN lane fails both tests and stays NaN
  v = v > hi ? hi : v;
  const D4 t = v * kLog2e + kShifter;
  const D4 kf = t - kShifter;                       // round(v / ln 2)
  I4 k, shifter_bits;
  std::memcpy(&k, &t, sizeof k);
  const D4 sh = D4{} + kShifter;
  std::memcpy(&shifter_bits, &sh, sizeof shifter_bits);
  k -= shifter_bits;
  const D4 r = (v - kf * kLn2Hi) - kf * kLn2Lo;     // |r| <= ln(2)/2
  // e^r by its Taylor series to r^13 (truncation under 1e-17 relative), Horner.
  D4 p = D4{} + 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // 2^k as two normal powers (k runs from -1075 to 1025), so that a subnormal result rounds once.
  const I4 kmin = I4{} - 1020, kmax = I4{} + 1023;
  I4 k1 = k < kmin ? kmin : k;
  k1 = k1 > kmax ? kmax : k1;
  const I4 e1 = (k1 + 1023) << 52, e2 = (k - k1 + 1023) << 52;
  D4 s1, s2;
  std::memcpy(&s1, &e1, sizeof s1);
  std::memcpy(&s2, &e2, sizeof s2);
  return p * s1 * s2;
}

}  // namespace vexp_detail

inline void exp_in_place(double* x, int64_t n) {
  using vexp_detail::D4;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    D4 v;
    std::memcpy(&v, x + i, sizeof v);
    v = vexp_detail::exp4(v);
    std::memcpy(x + i, &v, sizeof v);
  }
  if (i < n) {
    D4 v{};
    std::memcpy(&v, x + i, sizeof(double) * size_t(n - i));
    v = vexp_detail::exp4(v);
    std::memcpy(x + i, &v, sizeof(double) * size_t(n - i));
  }
}

}  // namespace xirang::cpu
