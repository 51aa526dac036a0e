// CPU per-head q/k RMSNorm: rmsnorm's arithmetic (kernels/cpu/rmsnorm.cc)
// on each q and k head of the packed qkv rows, the sum of squares and the
// weight-gradient reduction in double. 16-bit activations are widened to
// float per element; rstd is then F32, and dq_w, dk_w may be F32.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/rmsnorm_row.h"
#include "kernels/qk_norm.h"
#include "kernels/qk_norm_checks.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::normalize_row;
using cpu::store;
using qk_norm_checks::Dims;

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
        normalize_row(xn + h * D, h < H ? pq : pk, yn + h * D, pr + n * normed + h, D, eps);
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
          // dxi may be dyi (Overwrite): rmsnorm_row_backward reads each dy before writing its dx.
          cpu::rmsnorm_row_backward(xi, dyi, pw, double(pr[n * normed + h]), pdx + n * W + h * D, pdw, D, acc);
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
    cpu::add_chunk_sums<S>(dq_w, part, 2 * D, 0, D);
    cpu::add_chunk_sums<S>(dk_w, part, 2 * D, D, D);
  });
}

}  // namespace xirang
