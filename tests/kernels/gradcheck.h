// tests/kernels/gradcheck.h: central-difference gradients for the float64
// gradient checks of the kernel and model tests.
//
// A gradient check perturbs one input element at a time, re-runs the forward
// pass and compares (L(x + h) - L(x - h)) / 2h with the backward's gradient.
// The loss is a callable that reads the inputs it closes over, so the same
// helpers serve a kernel (L = sum(y * R)) and a whole model.
//
//   auto loss = [&] {                      // L = sum(y * R) for a fixed random R
//     layernorm_forward(ctx, view(y, {N, C}), ..., view(x, {N, C}), ...);
//     double L = 0;
//     for (size_t i = 0; i < y.size(); ++i) L += y[i] * R[i];
//     return L;
//   };
//   layernorm_backward(ctx, view(dx, {N, C}), ..., view(R, {N, C}), ...);  // dy = R
//   EXPECT_LT(normwise_error(numeric_gradient(x, 1e-6, loss), dx), 1e-6);
//
// Truncation error is ~h^2 and roundoff ~1e-16 |L| / h, so h = 1e-6 leaves
// both far below a 1e-6 bound for losses of order one.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "core/error.h"

namespace xirang::test {

// dL/dv by central differences; v is restored to its value afterwards.
template <class Loss>
double central_difference(double& v, double h, Loss&& loss) {
  const double keep = v;
  v = keep + h;
  const double lp = loss();
  v = keep - h;
  const double lm = loss();
  v = keep;
  return (lp - lm) / (2 * h);
}

// The central-difference gradient of loss() with respect to every element of x.
template <class Loss>
std::vector<double> numeric_gradient(std::vector<double>& x, double h, Loss&& loss) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) g[i] = central_difference(x[i], h, loss);
  return g;
}

// ||numeric - analytic|| / ||analytic||: one number for a whole tensor, so
// elements whose gradient is near zero do not need a floor of their own.
inline double normwise_error(const std::vector<double>& numeric, const std::vector<double>& analytic) {
  XR_CHECK(numeric.size() == analytic.size(), "normwise_error: ", numeric.size(), " numeric and ", analytic.size(),
           " analytic elements");
  double num = 0, den = 0;
  for (size_t i = 0; i < numeric.size(); ++i) {
    num += (numeric[i] - analytic[i]) * (numeric[i] - analytic[i]);
    den += analytic[i] * analytic[i];
  }
  return std::sqrt(num / den);
}

}  // namespace xirang::test
