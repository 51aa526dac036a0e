// CUDA SwiGLU, separate and packed, storage S in {f32, bf16, f16},
// arithmetic in float: one thread per output element over rows of F
// elements of g and u placed `stride` apart (F, or 2F in the packed [g | u]
// buffer). expf, not __expf: the fast form's error near g ~ 0 would show
// against the CPU's float exp beyond a rounding.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/swiglu.h"
#include "kernels/swiglu_checks.h"

namespace xirang::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 1u << 20;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

template <class S>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(S* __restrict__ h, const S* __restrict__ g, const S* __restrict__ u, int64_t rows,
                          int64_t F, int64_t stride) {
  const int64_t total = rows * F;
  for (int64_t k = int64_t(blockIdx.x) * kThreads + threadIdx.x; k < total; k += int64_t(gridDim.x) * kThreads) {
    const int64_t r = k / F, j = k % F;
    const float gv = load(g[r * stride + j]);
    h[k] = store<S>((gv * sigmoid(gv)) * load(u[r * stride + j]));
  }
}

// dg, du may alias g, u (no __restrict__ on them): a thread reads its
// element of g and u before writing the same element of dg and du.
template <class S>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(S* dg, S* du, const S* __restrict__ dh, const S* g, const S* u, int64_t rows, int64_t F,
                           int64_t stride) {
  const int64_t total = rows * F;
  for (int64_t k = int64_t(blockIdx.x) * kThreads + threadIdx.x; k < total; k += int64_t(gridDim.x) * kThreads) {
    const int64_t r = k / F, j = k % F, e = r * stride + j;
    const float gv = load(g[e]), uv = load(u[e]), dhv = load(dh[k]);
    const float s = sigmoid(gv);
    dg[e] = store<S>(dhv * uv * s * (1.f + gv * (1.f - s)));
    du[e] = store<S>(dhv * (gv * s));
  }
}

unsigned grid_for(int64_t total) {
  return unsigned(std::min<int64_t>(std::max<int64_t>(1, (total + kThreads - 1) / kThreads), kMaxBlocks));
}

template <class S>
S* ptr(const Tensor& t) {
  return static_cast<S*>(t.raw());
}

void launch_forward(const KernelContext& ctx, const char* op, const Tensor& h, const Tensor& g_base, int64_t u_off,
                    const Tensor& u_base, const swiglu_checks::Dims& d) {
  if (d.rows * d.F == 0) return;
  dispatch_storage(h.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    swiglu_forward_kernel<S><<<grid_for(d.rows * d.F), kThreads, 0, stream(ctx)>>>(
        ptr<S>(h), ptr<S>(g_base), ptr<S>(u_base) + u_off, d.rows, d.F, d.stride);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void launch_backward(const KernelContext& ctx, const char* op, const Tensor& dg_base, const Tensor& du_base,
                     const Tensor& dh, const Tensor& g_base, const Tensor& u_base, int64_t u_off,
                     const swiglu_checks::Dims& d) {
  if (d.rows * d.F == 0) return;
  dispatch_storage(dh.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    swiglu_backward_kernel<S><<<grid_for(d.rows * d.F), kThreads, 0, stream(ctx)>>>(
        ptr<S>(dg_base), ptr<S>(du_base) + u_off, ptr<S>(dh), ptr<S>(g_base), ptr<S>(u_base) + u_off, d.rows, d.F,
        d.stride);
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace

void swiglu_forward(const KernelContext& ctx, Tensor h, const Tensor& g, const Tensor& u) {
  const char* op = "swiglu_forward";
  require_cuda(ctx, op);
  const swiglu_checks::Dims d = swiglu_checks::check_separate(op, {{"h", &h}, {"u", &u}}, g);
  check_on_device(op, {{"h", &h}, {"g", &g}, {"u", &u}});
  launch_forward(ctx, op, h, g, 0, u, d);
}

void swiglu_backward(const KernelContext& ctx, Tensor dg, Tensor du, const Tensor& dh, const Tensor& g,
                     const Tensor& u) {
  const char* op = "swiglu_backward";
  require_cuda(ctx, op);
  const swiglu_checks::Dims d =
      swiglu_checks::check_separate(op, {{"dg", &dg}, {"du", &du}, {"dh", &dh}, {"u", &u}}, g);
  check_on_device(op, {{"dg", &dg}, {"du", &du}, {"dh", &dh}, {"g", &g}, {"u", &u}});
  launch_backward(ctx, op, dg, du, dh, g, u, 0, d);
}

void swiglu_packed_forward(const KernelContext& ctx, Tensor h, const Tensor& gu) {
  const char* op = "swiglu_packed_forward";
  require_cuda(ctx, op);
  const swiglu_checks::Dims d = swiglu_checks::check_packed(op, "h", h, gu, {});
  check_on_device(op, {{"h", &h}, {"gu", &gu}});
  launch_forward(ctx, op, h, gu, d.F, gu, d);
}

void swiglu_packed_backward(const KernelContext& ctx, Tensor dgu, const Tensor& dh, const Tensor& gu) {
  const char* op = "swiglu_packed_backward";
  require_cuda(ctx, op);
  const swiglu_checks::Dims d = swiglu_checks::check_packed(op, "dh", dh, gu, {{"dgu", &dgu}});
  check_on_device(op, {{"dgu", &dgu}, {"dh", &dh}, {"gu", &gu}});
  launch_backward(ctx, op, dgu, dgu, dh, gu, gu, d.F, d);
}

}  // namespace xirang::cuda
