// CPU SwiGLU, separate and packed: both run one loop over rows of F
// elements of g and u placed `stride` apart (F, or 2F in the packed buffer).
#include "kernels/swiglu.h"

#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/swiglu_checks.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::load;
using cpu::store;

namespace {

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));  // exp overflows to inf for x < -88 (float): s = 0, as it should
}

template <class S>
void forward_rows(S* h, const S* g, const S* u, const swiglu_checks::Dims& d) {
  using T = compute_t<S>;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t j = 0; j < d.F; ++j) {
      const T gv = load(g[r * d.stride + j]);
      h[r * d.F + j] = store<S>(T(gv * sigmoid(gv)) * load(u[r * d.stride + j]));
    }
}

// dg and du may alias g and u: both inputs of an element are read before
// either output is written.
template <class S>
void backward_rows(S* dg, S* du, const S* dh, const S* g, const S* u, const swiglu_checks::Dims& d) {
  using T = compute_t<S>;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t j = 0; j < d.F; ++j) {
      const int64_t k = r * d.stride + j;
      const T gv = load(g[k]), uv = load(u[k]), dhv = load(dh[r * d.F + j]);
      const T s = sigmoid(gv);
      dg[k] = store<S>(dhv * uv * s * (T(1) + gv * (T(1) - s)));
      du[k] = store<S>(dhv * (gv * s));
    }
}

}  // namespace

void swiglu_forward(const KernelContext& ctx, Tensor h, const Tensor& g, const Tensor& u) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, swiglu_forward(ctx, h, g, u));
  const char* op = "swiglu_forward";
  cpu::require_cpu(ctx, op);
  const swiglu_checks::Dims d = swiglu_checks::check_separate(op, {{"h", &h}, {"u", &u}}, g);
  dispatch_storage(g.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    forward_rows(h.data<S>(), g.data<S>(), u.data<S>(), d);
  });
}

void swiglu_backward(const KernelContext& ctx, Tensor dg, Tensor du, const Tensor& dh, const Tensor& g,
                     const Tensor& u) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, swiglu_backward(ctx, dg, du, dh, g, u));
  const char* op = "swiglu_backward";
  cpu::require_cpu(ctx, op);
  const swiglu_checks::Dims d =
      swiglu_checks::check_separate(op, {{"dg", &dg}, {"du", &du}, {"dh", &dh}, {"u", &u}}, g);
  dispatch_storage(g.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    backward_rows(dg.data<S>(), du.data<S>(), dh.data<S>(), g.data<S>(), u.data<S>(), d);
  });
}

void swiglu_packed_forward(const KernelContext& ctx, Tensor h, const Tensor& gu) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, swiglu_packed_forward(ctx, h, gu));
  const char* op = "swiglu_packed_forward";
  cpu::require_cpu(ctx, op);
  const swiglu_checks::Dims d = swiglu_checks::check_packed(op, "h", h, gu, {});
  dispatch_storage(gu.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    const S* g = gu.data<S>();
    forward_rows(h.data<S>(), g, g + d.F, d);
  });
}

void swiglu_packed_backward(const KernelContext& ctx, Tensor dgu, const Tensor& dh, const Tensor& gu) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, swiglu_packed_backward(ctx, dgu, dh, gu));
  const char* op = "swiglu_packed_backward";
  cpu::require_cpu(ctx, op);
  const swiglu_checks::Dims d = swiglu_checks::check_packed(op, "dh", dh, gu, {{"dgu", &dgu}});
  dispatch_storage(gu.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    const S* g = gu.data<S>();
    S* dg = dgu.data<S>();
    backward_rows(dg, dg + d.F, dh.data<S>(), g, g + d.F, d);
  });
}

}  // namespace xirang
