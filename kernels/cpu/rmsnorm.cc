// CPU RMSNorm: the sum of squares and the weight-gradient reduction in
// double. 16-bit activations are widened to float per element; rstd is then
// F32, and dw may be F32 (kernels/context.h).
#include "kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/rmsnorm_row.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::normalize_row;
using cpu::store;

namespace {

struct RmsNormDims {
  int64_t N, C;
};

void check_eps(const char* op, double eps) {
  if (!(eps >= 0) || !std::isfinite(eps)) fail(ErrorKind::Shape, op, ": eps must be finite and >= 0, got ", eps);
}

// Checks shared by the forward ops; returns (rows, width).
RmsNormDims check_forward(const char* op, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                          double eps) {
  if (x.rank() < 1) fail(ErrorKind::Shape, op, ": x must have at least one dimension, got ", x.shape().str());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, y, x);
  check_shape(op, "w", w, {C});
  check_shape(op, "rstd", rstd.flat(), {N});
  const DType s = x.dtype();
  check_dtype(op, "y", y, s);
  check_dtype(op, "w", w, s);
  cpu::check_stat_dtype(op, "rstd", rstd, s);
  check_eps(op, eps);
  return {N, C};
}

}  // namespace

void rmsnorm_forward(const KernelContext& ctx, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, double eps) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, rmsnorm_forward(ctx, y, rstd, x, w, eps));
  const char* op = "rmsnorm_forward";
  cpu::require_cpu(ctx, op);
  // Plain variables, not a structured binding: the OpenMP loops inside lambdas capture them (clang 14).
  const auto nc = check_forward(op, y, rstd, x, w, eps);
  const int64_t N = nc.N, C = nc.C;
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* px = x.data<S>();
    const S* pw = w.data<S>();
    S* py = y.data<S>();
    St* pr = rstd.data<St>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) normalize_row(px + i * C, pw, py + i * C, pr + i, C, eps);
  });
}

// Row by row: the sum is stored (rounded to S), then normalized from the
// stored values, so the result equals add() followed by rmsnorm_forward()
// bit for bit while the row is still in cache.
void residual_rmsnorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor rstd, const Tensor& a,
                              const Tensor& b, const Tensor& w, double eps) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, residual_rmsnorm_forward(ctx, res, y, rstd, a, b, w, eps));
  const char* op = "residual_rmsnorm_forward";
  cpu::require_cpu(ctx, op);
  // Plain variables, not a structured binding: the OpenMP loops inside lambdas capture them (clang 14).
  const auto nc = check_forward(op, y, rstd, a, w, eps);
  const int64_t N = nc.N, C = nc.C;
  check_same_shape(op, res, a);
  check_same_shape(op, b, a);
  check_dtype(op, "res", res, a.dtype());
  check_dtype(op, "b", b, a.dtype());
  dispatch_storage(a.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* pa = a.data<S>();
    const S* pb = b.data<S>();
    const S* pw = w.data<S>();
    S* pres = res.data<S>();
    S* py = y.data<S>();
    St* pr = rstd.data<St>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      S* ri = pres + i * C;  // may alias a row of a or b: each element is read before it is written
      for (int64_t j = 0; j < C; ++j) ri[j] = store<S>(load(pa[i * C + j]) + load(pb[i * C + j]));
      normalize_row(ri, pw, py + i * C, pr + i, C, eps);
    }
  });
}

void rmsnorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                      const Tensor& w, const Tensor& rstd, GradMode dx_mode) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, rmsnorm_backward(ctx, dx, dw, dy, x, w, rstd, dx_mode));
  const char* op = "rmsnorm_backward";
  cpu::require_cpu(ctx, op);
  if (x.rank() < 1) fail(ErrorKind::Shape, op, ": x must have at least one dimension, got ", x.shape().str());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, dy, x);
  check_same_shape(op, dx, x);
  check_shape(op, "dw", dw, {C});
  check_shape(op, "w", w, {C});
  check_shape(op, "rstd", rstd.flat(), {N});
  const DType s = x.dtype();
  check_dtype(op, "dy", dy, s);
  check_dtype(op, "dx", dx, s);
  check_dtype(op, "w", w, s);
  cpu::check_stat_dtype(op, "rstd", rstd, s);
  cpu::check_grad_dtype(op, "dw", dw, s);
  dispatch_storage(s, op, [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* px = x.data<S>();
    const S* pdy = dy.data<S>();
    const S* pw = w.data<S>();
    const St* pr = rstd.data<St>();
    S* pdx = dx.data<S>();
    const bool acc = dx_mode == GradMode::Accumulate;
    // Per-chunk partial sums of dw, reduced in chunk order afterwards, so
    // the result does not depend on the thread count.
    double* part = cpu::thread_scratch<double, cpu::kScratchReduce>(size_t(cpu::kReduceChunks * C));
    std::fill(part, part + cpu::kReduceChunks * C, 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < cpu::kReduceChunks; ++c) {
      double* pdw = part + c * C;
      for (int64_t i = cpu::chunk_begin(N, c); i < cpu::chunk_begin(N, c + 1); ++i)
        cpu::rmsnorm_row_backward(px + i * C, pdy + i * C, pw, double(pr[i]), pdx + i * C, pdw, C, acc);
    }
    cpu::add_chunk_sums<S>(dw, part, C, 0, C);
  });
}

}  // namespace xirang
