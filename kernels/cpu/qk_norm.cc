// CPU per-head q/k RMSNorm: rmsnorm's arithmetic (kernels/cpu/rmsnorm.cc)
// on each q and k head of the packed qkv rows, the sum of squares and the
// weight-gradient reduction in double. 16-bit activations are widened to
// float per element; rstd is then F32, and dq_w, dk_w may be F32.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/qk_norm.h"
#include "kernels/qk_norm_checks.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::store;
using qk_norm_checks::Dims;

namespace {

// One head: y = x * rstd * w, rstd from the double sum of squares, the
// scaling in the compute type; rmsnorm.cc's normalize_row, so a head comes
// out bit for bit as rmsnorm_forward of it. y may be x.
template <class S>
void normalize_head(const S* xi, const S* pw, S* yi, compute_t<S>* rstd, int64_t D, double eps) {
  using T = compute_t<S>;
  double ss = 0;
  for (int64_t j = 0; j < D; ++j) ss += double(load(xi[j])) * load(xi[j]);
  const double r = 1.0 / std::sqrt(ss / double(D) + eps);
  const T rt = T(r);
  for (int64_t j = 0; j < D; ++j) yi[j] = store<S>(T(load(xi[j]) * rt) * load(pw[j]));
  *rstd = rt;
}

}  // namespace

void qk_rmsnorm_forward(const KernelContext& ctx, Tensor out, Tensor rstd, const Tensor& qkv, const Tensor& q_w,
                        const Tensor& k_w, int n_head, int n_kv_head, double eps) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, qk_rmsnorm_forward(ctx, out, rstd, qkv, q_w, k_w, n_head, n_kv_head, eps));
  const char* op = "qk_rmsnorm_forward";
  cpu::require_cpu(ctx, op);
  const Dims d = qk_norm_checks::check_shapes(op, qkv, q_w, k_w, rstd, n_head, n_kv_head);
  check_same_shape(op, out, qkv);
  const DType s = qkv.dtype();
  check_dtype(op, "out", out, s);
  check_dtype(op, "q_w", q_w, s);
  check_dtype(op, "k_w", k_w, s);
  cpu::check_stat_dtype(op, "rstd", rstd, s);
  qk_norm_checks::check_eps(op, eps);
  // Plain variables, not a structured binding: the OpenMP loops inside lambdas capture them (clang 14).
  const int64_t N = d.tokens, W = d.width, D = d.D, H = d.H, normed = d.normed();
  const bool copy_v = !qk_norm_checks::same_storage(out, qkv);
  dispatch_storage(s, op, [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* px = qkv.data<S>();
    const S* pq = q_w.data<S>();
    const S* pk = k_w.data<S>();
    S* py = out.data<S>();
    St* pr = rstd.data<St>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const S* xn = px + n * W;
      S* yn = py + n * W;
      for (int64_t h = 0; h < normed; ++h)
        normalize_head(xn + h * D, h < H ? pq : pk, yn + h * D, pr + n * normed + h, D, eps);
      if (copy_v) std::copy(xn + normed * D, xn + W, yn + normed * D);
    }
  });
}

void qk_rmsnorm_backward(const KernelContext& ctx, Tensor dqkv, Tensor dq_w, Tensor dk_w, const Tensor& dout,
                         const Tensor& qkv, const Tensor& q_w, const Tensor& k_w, const Tensor& rstd, int n_head,
                         int n_kv_head, GradMode dx_mode) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Norm);
  XR_ON_CUDA(ctx, qk_rmsnorm_backward(ctx, dqkv, dq_w, dk_w, dout, qkv, q_w, k_w, rstd, n_head, n_kv_head, dx_mode));
  const char* op = "qk_rmsnorm_backward";
  cpu::require_cpu(ctx, op);
  const Dims d = qk_norm_checks::check_shapes(op, qkv, q_w, k_w, rstd, n_head, n_kv_head);
  check_same_shape(op, dout, qkv);
  check_same_shape(op, dqkv, qkv);
  check_shape(op, "dq_w", dq_w, {d.D});
  check_shape(op, "dk_w", dk_w, {d.D});
  const DType s = qkv.dtype();
  check_dtype(op, "dout", dout, s);
  check_dtype(op, "dqkv", dqkv, s);
  check_dtype(op, "q_w", q_w, s);
  check_dtype(op, "k_w", k_w, s);
  cpu::check_stat_dtype(op, "rstd", rstd, s);
  cpu::check_grad_dtype(op, "dq_w", dq_w, s);
  cpu::check_grad_dtype(op, "dk_w", dk_w, s);
  const bool acc = dx_mode == GradMode::Accumulate;
  qk_norm_checks::check_backward_alias(op, dqkv, dout, acc);
  const int64_t N = d.tokens, W = d.width, D = d.D, H = d.H, normed = d.normed();
  const bool in_place = qk_norm_checks::same_storage(dqkv, dout);
  dispatch_storage(s, op, [&](auto tag) {
    using S = decltype(tag);
    using St = compute_t<S>;
    const S* px = qkv.data<S>();
    const S* pdy = dout.data<S>();
    const S* pq = q_w.data<S>();
    const S* pk = k_w.data<S>();
    const St* pr = rstd.data<St>();
    S* pdx = dqkv.data<S>();
    // Per-chunk partial sums of [dq_w | dk_w] (2 D), reduced in chunk order
    // afterwards, so the result does not depend on the thread count.
    double* part = cpu::thread_scratch<double, cpu::kScratchReduce>(size_t(cpu::kReduceChunks * 2 * D));
    std::fill(part, part + cpu::kReduceChunks * 2 * D, 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < cpu::kReduceChunks; ++c) {
      for (int64_t n = cpu::chunk_begin(N, c); n < cpu::chunk_begin(N, c + 1); ++n) {
        for (int64_t h = 0; h < normed; ++h) {
          const S* xi = px + n * W + h * D;
          const S* dyi = pdy + n * W + h * D;
          const S* pw = h < H ? pq : pk;
          double* pdw = part + c * 2 * D + (h < H ? 0 : D);
          const double r = pr[n * normed + h];
          double sum_gx = 0;  // sum_j g_j xhat_j
          for (int64_t j = 0; j < D; ++j) {
            const double xhat = double(load(xi[j])) * r;
            sum_gx += double(load(dyi[j])) * load(pw[j]) * xhat;
            pdw[j] += double(load(dyi[j])) * xhat;
          }
          const double mean_gx = sum_gx / double(D);
          S* dxi = pdx + n * W + h * D;  // may be dyi (Overwrite): dyi[j] is read before dxi[j] is written
          for (int64_t j = 0; j < D; ++j) {
            const double xhat = double(load(xi[j])) * r;
            const double v = r * (double(load(dyi[j])) * load(pw[j]) - xhat * mean_gx);
            dxi[j] = acc ? store<S>(load(dxi[j]) + v) : store<S>(v);
          }
        }
        // v passes through: its gradient is dout's.
        const S* dyv = pdy + n * W + normed * D;
        S* dxv = pdx + n * W + normed * D;
        if (acc)
          for (int64_t j = 0; j < W - normed * D; ++j) dxv[j] = store<S>(load(dxv[j]) + load(dyv[j]));
        else if (!in_place)
          std::copy(dyv, dyv + (W - normed * D), dxv);
      }
    }
    auto reduce = [&](Tensor& dw, int64_t offset) {
      cpu::dispatch_grad<S>(dw.dtype(), [&](auto gtag) {
        using G = decltype(gtag);
        G* g = dw.data<G>();
        for (int64_t j = 0; j < D; ++j) {
          double sum = 0;
          for (int64_t c = 0; c < cpu::kReduceChunks; ++c) sum += part[c * 2 * D + offset + j];
          // 16-bit: add in double, round once; F32/F64: add the sum rounded to G.
          if constexpr (is_16bit_v<S>) g[j] = store<G>(double(load(g[j])) + sum);
          else g[j] += G(sum);
        }
      });
    };
    reduce(dq_w, 0);
    reduce(dk_w, D);
  });
}

}  // namespace xirang
