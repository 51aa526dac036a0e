// kernels/cpu/rmsnorm_row.h: one row of RMSNorm, forward and backward, and
// the chunked reduction of its weight gradient (private to kernels/cpu):
// rmsnorm.cc runs it over the rows of a tensor, qk_norm.cc over the q and k
// heads of a qkv tensor, so that a head is normalized bit for bit as
// rmsnorm_forward would normalize it.
//
//   normalize_row(x, w, y, &rstd, C, eps);                    // y = x * rstd * w
//   rmsnorm_row_backward(x, dy, w, rstd, dx, dw_part, C, accumulate);
//   add_chunk_sums<S>(dw, part, stride, offset, C);           // dw += sum over chunks
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cpu/common.h"

namespace xirang::cpu {

// y = x * rstd * w, rstd from the double sum of squares, the scaling in the
// compute type. y may be x.
template <class S>
void normalize_row(const S* xi, const S* pw, S* yi, compute_t<S>* rstd, int64_t C, double eps) {
  using T = compute_t<S>;
  double ss = 0;
  for (int64_t j = 0; j < C; ++j) ss += double(load(xi[j])) * load(xi[j]);
  const double r = 1.0 / std::sqrt(ss / double(C) + eps);
  const T rt = T(r);
  for (int64_t j = 0; j < C; ++j) yi[j] = store<S>(T(load(xi[j]) * rt) * load(pw[j]));
  *rstd = rt;
}

// dx (overwritten, or added to with `accumulate`) of one row, in double, and
// the row's share of dw added to pdw (double, C). dx may be dy (Overwrite):
// each dy element is read before its dx is written.
template <class S>
void rmsnorm_row_backward(const S* xi, const S* dyi, const S* pw, double r, S* dxi, double* pdw, int64_t C,
                          bool accumulate) {
  double sum_gx = 0;  // sum_j g_j xhat_j
  for (int64_t j = 0; j < C; ++j) {
    const double xhat = double(load(xi[j])) * r;
    sum_gx += double(load(dyi[j])) * load(pw[j]) * xhat;
    pdw[j] += double(load(dyi[j])) * xhat;
  }
  const double mean_gx = sum_gx / double(C);
  for (int64_t j = 0; j < C; ++j) {
    const double xhat = double(load(xi[j])) * r;
    const double v = r * (double(load(dyi[j])) * load(pw[j]) - xhat * mean_gx);
    dxi[j] = accumulate ? store<S>(load(dxi[j]) + v) : store<S>(v);
  }
}

// dw (C) += the sum over kReduceChunks partial rows part[c * stride + offset
// + j], added in chunk order (so independent of the thread count). 16-bit
// storage adds in double and rounds once; F32/F64 add the sum rounded to G.
template <class S>
void add_chunk_sums(const Tensor& dw, const double* part, int64_t stride, int64_t offset, int64_t C) {
  dispatch_grad<S>(dw.dtype(), [&](auto gtag) {
    using G = decltype(gtag);
    G* g = dw.data<G>();
    for (int64_t j = 0; j < C; ++j) {
      double sum = 0;
      for (int64_t c = 0; c < kReduceChunks; ++c) sum += part[c * stride + offset + j];
      if constexpr (is_16bit_v<S>) g[j] = store<G>(double(load(g[j])) + sum);
      else g[j] += G(sum);
    }
  });
}

}  // namespace xirang::cpu
