// CPU LayerNorm: statistics and the weight/bias gradient reductions in double.
// 16-bit activations are widened to float per element; mean and rstd are
// then F32, and dw/db may be F32 (kernels/context.h).
#include "kernels/layernorm.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::store;

namespace {

// One row: y = (x - mean) * rstd * w + b, with the statistics in double
// (two-pass variance) and the affine part in the compute type.
template <class S>
void normalize_row(const S* xi, const S* pw, const S* pb, S* yi, compute_t<S>* mean, compute_t<S>* rstd, int64_t C) {
  using T = compute_t<S>;
  double s = 0;
  for (int64_t j = 0; j < C; ++j) s += load(xi[j]);
  double m = s / double(C);
  double v = 0;
  for (int64_t j = 0; j < C; ++j) v += (load(xi[j]) - m) * (load(xi[j]) - m);
  double r = 1.0 / std::sqrt(v / double(C) + kLayerNormEps);
  for (int64_t j = 0; j < C; ++j) yi[j] = store<S>(T(T((load(xi[j]) - m) * r) * load(pw[j]) + load(pb[j])));
  *mean = T(m);
  *rstd = T(r);
}

struct LayerNormDims {
  int64_t N, C;
};

// Checks shared by the forward ops; returns (rows, width).
LayerNormDims check_forward(const char* op, const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                            const Tensor& w, const Tensor& b) {
  Tensor x2 = x.flat2d();
  int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, y, x);
  check_shape(op, "w", w, {C});
  check_shape(op, "b", b, {C});
  check_shape(op, "mean", mean.flat(), {N});
  check_shape(op, "rstd", rstd.flat(), {N});
  const DType s = x.dtype();
  check_dtype(op, "y", y, s);
  check_dtype(op, "w", w, s);
  check_dtype(op, "b", b, s);
  cpu::check_stat_dtype(op, "mean", mean, s);
  cpu::check_stat_dtype(op, "rstd", rstd, s);
  return {N, C};
}

}  // namespace

void layernorm_forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, layernorm_forward(ctx, y, mean, rstd, x, w, b));
  cpu::require_cpu(ctx, "layernorm_forward");
  // Plain variables, not a structured binding: the OpenMP loops inside lambdas capture them (clang 14).
  const auto nc = check_forward("layernorm_forward", y, mean, rstd, x, w, b);
  const int64_t N = nc.N, C = nc.C;
  dispatch_storage(x.dtype(), "layernorm_forward", [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* px = x.data<S>();
    const S* pw = w.data<S>();
    const S* pb = b.data<S>();
    S* py = y.data<S>();
    St* pm = mean.data<St>();
    St* pr = rstd.data<St>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) normalize_row(px + i * C, pw, pb, py + i * C, pm + i, pr + i, C);
  });
}

// Row by row: the sum is stored (rounded to S), then normalized from the
// stored values, so the result equals add() followed by layernorm_forward()
// bit for bit while the row is still in cache.
void residual_layernorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor mean, Tensor rstd,
                                const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, residual_layernorm_forward(ctx, res, y, mean, rstd, a, b, w, bias));
  const char* op = "residual_layernorm_forward";
  cpu::require_cpu(ctx, op);
  check_same_shape(op, res, a);
  check_same_shape(op, b, a);
  check_dtype(op, "res", res, a.dtype());
  check_dtype(op, "b", b, a.dtype());
  // Plain variables, not a structured binding: the OpenMP loops inside lambdas capture them (clang 14).
  const auto nc = check_forward(op, y, mean, rstd, a, w, bias);
  const int64_t N = nc.N, C = nc.C;
  dispatch_storage(a.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* pa = a.data<S>();
    const S* pbb = b.data<S>();
    const S* pw = w.data<S>();
    const S* pb = bias.data<S>();
    S* pres = res.data<S>();
    S* py = y.data<S>();
    St* pm = mean.data<St>();
    St* pr = rstd.data<St>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      S* ri = pres + i * C;  // may alias a row of a (or b): each element is read before it is written
      for (int64_t j = 0; j < C; ++j) ri[j] = store<S>(load(pa[i * C + j]) + load(pbb[i * C + j]));
      normalize_row(ri, pw, pb, py + i * C, pm + i, pr + i, C);
    }
  });
}

namespace {

// grad (C) += the chunk partials summed in chunk order. F32 and F64 add the
// sum rounded to their type (as they always have); the 16-bit paths add in
// double and round once.
template <class S, class G>
void add_partials(G* grad, const double* part, int64_t stride, int64_t C) {
  for (int64_t j = 0; j < C; ++j) {
    double sum = 0;
    for (int64_t c = 0; c < cpu::kReduceChunks; ++c) sum += part[c * stride + j];
    if constexpr (is_16bit_v<S>) grad[j] = store<G>(double(load(grad[j])) + sum);
    else grad[j] += G(sum);
  }
}

}  // namespace

void layernorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor db, const Tensor& dy, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, GradMode dx_mode) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, layernorm_backward(ctx, dx, dw, db, dy, x, w, mean, rstd, dx_mode));
  const char* op = "layernorm_backward";
  cpu::require_cpu(ctx, op);
  Tensor x2 = x.flat2d();
  int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, dy, x);
  check_same_shape(op, dx, x);
  check_shape(op, "dw", dw, {C});
  check_shape(op, "db", db, {C});
  check_shape(op, "w", w, {C});
  check_shape(op, "mean", mean.flat(), {N});
  check_shape(op, "rstd", rstd.flat(), {N});
  const DType s = x.dtype();
  check_dtype(op, "dy", dy, s);
  check_dtype(op, "dx", dx, s);
  check_dtype(op, "w", w, s);
  cpu::check_stat_dtype(op, "mean", mean, s);
  cpu::check_stat_dtype(op, "rstd", rstd, s);
  cpu::check_grad_dtype(op, "dw", dw, s);
  cpu::check_grad_dtype(op, "db", db, s);
  dispatch_storage(s, op, [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* px = x.data<S>();
    const S* pdy = dy.data<S>();
    const S* pw = w.data<S>();
    const St* pm = mean.data<St>();
    const St* pr = rstd.data<St>();
    S* pdx = dx.data<S>();
    const bool acc = dx_mode == GradMode::Accumulate;
    // Per-chunk partial sums of dw and db, reduced in chunk order afterwards.
    double* part = cpu::thread_scratch<double, cpu::kScratchReduce>(size_t(cpu::kReduceChunks * 2 * C));
    std::fill(part, part + cpu::kReduceChunks * 2 * C, 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < cpu::kReduceChunks; ++c) {
      double* pdw = part + c * 2 * C;
      double* pdb = pdw + C;
      for (int64_t i = cpu::chunk_begin(N, c); i < cpu::chunk_begin(N, c + 1); ++i) {
        const S* xi = px + i * C;
        const S* dyi = pdy + i * C;
        double m = pm[i], r = pr[i];
        double sum_g = 0, sum_gx = 0;  // mean of dxhat and of dxhat * xhat, times C
        for (int64_t j = 0; j < C; ++j) {
          double xhat = (load(xi[j]) - m) * r;
          double g = double(load(dyi[j])) * load(pw[j]);
          sum_g += g;
          sum_gx += g * xhat;
          pdw[j] += double(load(dyi[j])) * xhat;
          pdb[j] += load(dyi[j]);
        }
        sum_g /= double(C);
        sum_gx /= double(C);
        S* dxi = pdx + i * C;
        for (int64_t j = 0; j < C; ++j) {
          double xhat = (load(xi[j]) - m) * r;
          double v = r * (double(load(dyi[j])) * load(pw[j]) - sum_g - xhat * sum_gx);
          dxi[j] = acc ? store<S>(load(dxi[j]) + v) : store<S>(v);
        }
      }
    }
    cpu::dispatch_grad<S>(dw.dtype(), [&](auto gtag) {
      using G = decltype(gtag);
      add_partials<S>(dw.data<G>(), part, 2 * C, C);
    });
    cpu::dispatch_grad<S>(db.dtype(), [&](auto gtag) {
      using G = decltype(gtag);
      add_partials<S>(db.data<G>(), part + C, 2 * C, C);
    });
  });
}

}  // namespace xirang
