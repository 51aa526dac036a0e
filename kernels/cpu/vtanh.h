// kernels/cpu/vtanh.h: tanh over arrays of floats, computed in double and
// rounded to float once, in loops that vectorize (with vexp.h's e^x), for
// the GELU of kernels/cpu/elementwise.cc, where libm's scalar tanhf was the
// op's cost.
//
// For |u| >= 1/8 it is 1 - 2 / (e^{2u} + 1) (absolute error about 1e-16,
// relative under 1e-15 there); below, where that form would lose the
// relative accuracy of small results, the odd Taylor series to u^15
// (relative error under 1e-15). The float result is the correctly rounded
// tanh but in rare near-ties (tests/kernels/vexp_test.cc checks 1 ulp); over
// every 7th float |u| < 10 it is never farther from tanh(u) than glibc's
// tanhf, and differs from it in 5% of them. +-inf gives +-1, NaN stays
// NaN, -0 stays -0. The per-element choice of formula is a blend when the
// including file is compiled without FP traps (-fno-trapping-math), else a
// branch: the values are the same.
//
//   float u[n], t[n]; double scratch[n];
//   tanh_floats(u, t, n, scratch);  // t may alias u
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cpu/vexp.h"

namespace xirang::cpu {

inline void tanh_floats(const float* u, float* t, int64_t n, double* scratch) {
  for (int64_t j = 0; j < n; ++j) scratch[j] = 2.0 * double(u[j]);
  exp_in_place(scratch, n);
  for (int64_t j = 0; j < n; ++j) {
    const double x = u[j], x2 = x * x;
    double poly = -929569.0 / 638512875.0;
    poly = poly * x2 + 21844.0 / 6081075.0;
    poly = poly * x2 - 1382.0 / 155925.0;
    poly = poly * x2 + 62.0 / 2835.0;
    poly = poly * x2 - 17.0 / 315.0;
    poly = poly * x2 + 2.0 / 15.0;
    poly = poly * x2 - 1.0 / 3.0;
    const double small = std::copysign(x + x * x2 * poly, x);  // the sign of -0 too
    const double large = 1.0 - 2.0 / (scratch[j] + 1.0);
    t[j] = float(std::fabs(x) < 0.125 ? small : large);
  }
}

}  // namespace xirang::cpu
