// CUDA MoE router and permutation (kernels/moe.h), the same arithmetic as
// the CPU reference (kernels/cpu/moe_router.cc, moe_permute.cc): routing in
// f32, one thread per token for the router, the stable permutation by
// expert, and the row gather and fma-in-slot-order combine.
//
// The permutation here is the simple correct form: one thread per expert
// scans every slot in ascending order (stable by construction, E x T*k
// reads). A block-wide radix sort is the faster form once measured on a GPU.
// An expert id outside [0, E) is counted by no expert: the permutation
// checks that the counts add up to every slot (one 4-byte read back, which
// the caller's grouped product needs on the host anyway) and refuses the
// ids otherwise, before anything reads rows by them.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/moe.h"
#include "kernels/moe_checks.h"

namespace xirang::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.raw());
}

unsigned grid_for(int64_t total) {
  return unsigned(std::min<int64_t>(std::max<int64_t>(1, (total + kThreads - 1) / kThreads), int64_t(1) << 20));
}

__global__ void router_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int32_t* ids,
                              float* gates, float* scores, int32_t* counts, int64_t T, int64_t E, int64_t k,
                              bool softmax, bool normalize, bool force_balance) {
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= T) return;
  const float* l = logits + t * E;
  float* s = scores + t * E;
  if (softmax) {
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = fmaxf(m, l[e]);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += double(s[e] = expf(l[e] - m));
    const float inv = float(1.0 / sum);
    for (int64_t e = 0; e < E; ++e) s[e] *= inv;
  } else {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.f / (1.f + expf(-l[e]));
  }
  int32_t* id = ids + t * k;
  double sel = 0;
  for (int64_t j = 0; j < k; ++j) {  // strict > in ascending order: ties to the lower index
    int64_t best = -1;
    float best_v = 0;
    for (int64_t e = 0; e < E && !force_balance; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken |= id[i] == e;
      if (taken) continue;
      const float v = bias ? s[e] + bias[e] : s[e];
      if (best < 0 || v > best_v) best = e, best_v = v;
    }
    if (force_balance) best = (t * k + j) % E;  // k <= E: distinct choices
    id[j] = int32_t(best);
    sel += double(s[best]);
    if (counts) atomicAdd(counts + best, 1);  // integer adds: the order does not matter
  }
  const float inv = normalize ? float(1.0 / sel) : 1.f;
  for (int64_t j = 0; j < k; ++j) gates[t * k + j] = s[id[j]] * inv;
}

__global__ void router_backward_kernel(float* dlogits, const float* __restrict__ dgates, const int32_t* __restrict__ ids,
                                       const float* __restrict__ scores, int64_t T, int64_t E, int64_t k, bool softmax,
                                       bool normalize) {
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= T) return;
  const float* s = scores + t * E;
  const float* dg = dgates + t * k;
  const int32_t* id = ids + t * k;
  float* dl = dlogits + t * E;
  for (int64_t e = 0; e < E; ++e) dl[e] = 0;
  if (normalize) {
    double S = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) S += double(s[id[j]]);
    for (int64_t j = 0; j < k; ++j) dot += double(dg[j]) * double(s[id[j]]) / S;
    for (int64_t j = 0; j < k; ++j) dl[id[j]] = float((double(dg[j]) - dot) / S);
  } else {
    for (int64_t j = 0; j < k; ++j) dl[id[j]] = dg[j];
  }
  if (softmax) {
    double dot = 0;
    for (int64_t j = 0; j < k; ++j) dot += double(s[id[j]]) * double(dl[id[j]]);
    for (int64_t e = 0; e < E; ++e) dl[e] = float(double(s[e]) * (double(dl[e]) - dot));
  } else {
    for (int64_t e = 0; e < E; ++e) dl[e] = dl[e] * s[e] * (1.f - s[e]);
  }
}

// offsets[e + 1] = slots of expert e (thread e), then a one-thread prefix sum.
__global__ void count_kernel(const int32_t* __restrict__ ids, int32_t* offsets, int64_t n, int64_t E) {
  const int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (e == 0) offsets[0] = 0;
  if (e >= E) return;
  int32_t c = 0;
  for (int64_t s = 0; s < n; ++s) c += ids[s] == e;
  offsets[e + 1] = c;
}
__global__ void prefix_kernel(int32_t* offsets, int64_t E) {
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
}
__global__ void place_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ offsets, int32_t* sorted,
                             int32_t* rows, int64_t n, int64_t E) {
  const int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= E) return;
  int32_t r = offsets[e];
  for (int64_t s = 0; s < n; ++s)
    if (ids[s] == e) sorted[r] = int32_t(s), rows[s] = r, ++r;
}

template <class S>
__global__ void permute_kernel(S* xp, const S* __restrict__ x, const int32_t* __restrict__ sorted, int64_t n, int64_t k,
                               int64_t d) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n * d; i += int64_t(gridDim.x) * kThreads)
    xp[i] = x[(sorted[i / d] / k) * d + i % d];
}

template <class S>
__global__ void permute_backward_kernel(S* dx, const S* __restrict__ dxp, const int32_t* __restrict__ rows, int64_t T,
                                        int64_t k, int64_t d) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < T * d; i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / d, c = i % d;
    float acc = 0;
    for (int64_t j = 0; j < k; ++j) acc += load(dxp[rows[t * k + j] * d + c]);
    dx[i] = store<S>(acc);
  }
}

template <class S>
__global__ void combine_kernel(S* y, const S* __restrict__ yp, const float* __restrict__ gates,
                               const int32_t* __restrict__ rows, int64_t T, int64_t k, int64_t d) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < T * d; i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / d, c = i % d;
    float acc = 0;
    for (int64_t j = 0; j < k; ++j) acc = fmaf(gates[t * k + j], load(yp[rows[t * k + j] * d + c]), acc);
    y[i] = store<S>(acc);
  }
}

template <class S>
__global__ void combine_backward_kernel(S* dyp, float* dgates, const S* __restrict__ dy, const S* __restrict__ yp,
                                        const float* __restrict__ gates, const int32_t* __restrict__ rows, int64_t n,
                                        int64_t k, int64_t d) {
  const int64_t s = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (s >= n) return;
  const int64_t t = s / k, r = rows[s];
  double dot = 0;
  for (int64_t c = 0; c < d; ++c) {
    const float v = load(dy[t * d + c]);
    dot += double(load(yp[r * d + c])) * double(v);
    dyp[r * d + c] = store<S>(gates[s] * v);
  }
  dgates[s] = float(dot);
}

void check_f32_router(const char* op, const Tensor& logits) {
  check_dtype(op, "logits", logits, DType::F32);  // F64 routing is a CPU reference path
}

}  // namespace

void router_forward(const KernelContext& ctx, Tensor ids, Tensor gates, Tensor scores, Tensor counts,
                    const Tensor& logits, const Tensor& bias, const RouterOptions& opt) {
  const char* op = "router_forward";
  require_cuda(ctx, op);
  const moe_checks::RouterDims d = moe_checks::check_router(op, logits, ids, gates, scores, opt);
  check_f32_router(op, logits);
  if (bias.defined()) check_shape(op, "bias", bias, {d.E}), check_dtype(op, "bias", bias, DType::F32);
  if (counts.defined()) check_shape(op, "counts", counts, {d.E}), check_dtype(op, "counts", counts, DType::I32);
  check_on_device(op, {{"ids", &ids}, {"gates", &gates}, {"scores", &scores}, {"counts", &counts},
                       {"logits", &logits}, {"bias", &bias}});
  if (counts.defined()) XR_CUDA_CHECK(cudaMemsetAsync(counts.raw(), 0, counts.bytes(), stream(ctx)));
  if (d.T == 0) return;
  router_kernel<<<grid_for(d.T), kThreads, 0, stream(ctx)>>>(
      ptr<float>(logits), bias.defined() ? ptr<float>(bias) : nullptr, ptr<int32_t>(ids), ptr<float>(gates),
      ptr<float>(scores), counts.defined() ? ptr<int32_t>(counts) : nullptr, d.T, d.E, d.k,
      opt.score == RouterScore::Softmax, opt.normalize, opt.force_balance);
  XR_CUDA_LAUNCH_CHECK();
}

void router_backward(const KernelContext& ctx, Tensor dlogits, const Tensor& dgates, const Tensor& ids,
                     const Tensor& scores, const RouterOptions& opt) {
  const char* op = "router_backward";
  require_cuda(ctx, op);
  const moe_checks::RouterDims d = moe_checks::check_router(op, dlogits, ids, dgates, scores, opt);
  check_f32_router(op, dlogits);
  check_on_device(op, {{"dlogits", &dlogits}, {"dgates", &dgates}, {"ids", &ids}, {"scores", &scores}});
  if (d.T == 0) return;
  router_backward_kernel<<<grid_for(d.T), kThreads, 0, stream(ctx)>>>(
      ptr<float>(dlogits), ptr<float>(dgates), ptr<int32_t>(ids), ptr<float>(scores), d.T, d.E, d.k,
      opt.score == RouterScore::Softmax, opt.normalize);
  XR_CUDA_LAUNCH_CHECK();
}

void moe_permutation(const KernelContext& ctx, Tensor sorted_slots, Tensor slot_rows, Tensor offsets, const Tensor& ids,
                     int64_t num_experts) {
  const char* op = "moe_permutation";
  require_cuda(ctx, op);
  const int64_t n = moe_checks::check_permutation(op, sorted_slots, slot_rows, offsets, ids, num_experts);
  const int64_t E = num_experts;
  check_on_device(op, {{"sorted_slots", &sorted_slots}, {"slot_rows", &slot_rows}, {"offsets", &offsets}, {"ids", &ids}});
  count_kernel<<<grid_for(E), kThreads, 0, stream(ctx)>>>(ptr<int32_t>(ids), ptr<int32_t>(offsets), n, E);
  XR_CUDA_LAUNCH_CHECK();
  prefix_kernel<<<1, 1, 0, stream(ctx)>>>(ptr<int32_t>(offsets), E);
  XR_CUDA_LAUNCH_CHECK();
  place_kernel<<<grid_for(E), kThreads, 0, stream(ctx)>>>(ptr<int32_t>(ids), ptr<int32_t>(offsets),
                                                          ptr<int32_t>(sorted_slots), ptr<int32_t>(slot_rows), n, E);
  XR_CUDA_LAUNCH_CHECK();
  int32_t placed = 0;
  XR_CUDA_CHECK(cudaMemcpyAsync(&placed, ptr<int32_t>(offsets) + E, sizeof placed, cudaMemcpyDeviceToHost, stream(ctx)));
  XR_CUDA_CHECK(cudaStreamSynchronize(stream(ctx)));
  if (placed != n)
    fail(ErrorKind::Shape, op, ": ", n - placed, " of ", n, " slots have an expert outside 0 <= expert < ", E);
}

void moe_permute(const KernelContext& ctx, Tensor xp, const Tensor& x, const Tensor& sorted_slots) {
  const char* op = "moe_permute";
  require_cuda(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, x, xp, "sorted_slots", sorted_slots);
  check_on_device(op, {{"xp", &xp}, {"x", &x}, {"sorted_slots", &sorted_slots}});
  if (d.T * d.k * d.d == 0) return;
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    permute_kernel<S><<<grid_for(d.T * d.k * d.d), kThreads, 0, stream(ctx)>>>(
        ptr<S>(xp), ptr<S>(x), ptr<int32_t>(sorted_slots), d.T * d.k, d.k, d.d);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void moe_permute_backward(const KernelContext& ctx, Tensor dx, const Tensor& dxp, const Tensor& slot_rows) {
  const char* op = "moe_permute_backward";
  require_cuda(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, dx, dxp, "slot_rows", slot_rows);
  check_on_device(op, {{"dx", &dx}, {"dxp", &dxp}, {"slot_rows", &slot_rows}});
  if (d.T * d.d == 0) return;
  dispatch_storage(dx.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    permute_backward_kernel<S><<<grid_for(d.T * d.d), kThreads, 0, stream(ctx)>>>(
        ptr<S>(dx), ptr<S>(dxp), ptr<int32_t>(slot_rows), d.T, d.k, d.d);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void moe_unpermute_combine(const KernelContext& ctx, Tensor y, const Tensor& yp, const Tensor& gates,
                           const Tensor& slot_rows) {
  const char* op = "moe_unpermute_combine";
  require_cuda(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, y, yp, "slot_rows", slot_rows);
  check_shape(op, "gates", gates, {d.T, d.k});
  check_dtype(op, "gates", gates, DType::F32);
  check_on_device(op, {{"y", &y}, {"yp", &yp}, {"gates", &gates}, {"slot_rows", &slot_rows}});
  if (d.T * d.d == 0) return;
  dispatch_storage(y.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    combine_kernel<S><<<grid_for(d.T * d.d), kThreads, 0, stream(ctx)>>>(ptr<S>(y), ptr<S>(yp), ptr<float>(gates),
                                                                         ptr<int32_t>(slot_rows), d.T, d.k, d.d);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void moe_unpermute_combine_backward(const KernelContext& ctx, Tensor dyp, Tensor dgates, const Tensor& dy,
                                    const Tensor& yp, const Tensor& gates, const Tensor& slot_rows) {
  const char* op = "moe_unpermute_combine_backward";
  require_cuda(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, dy, yp, "slot_rows", slot_rows);
  check_same_shape(op, dyp, yp);
  check_dtype(op, "dyp", dyp, dy.dtype());
  check_shape(op, "gates", gates, {d.T, d.k});
  check_dtype(op, "gates", gates, DType::F32);
  check_shape(op, "dgates", dgates, {d.T, d.k});
  check_dtype(op, "dgates", dgates, DType::F32);
  check_on_device(op, {{"dyp", &dyp}, {"dgates", &dgates}, {"dy", &dy}, {"yp", &yp}, {"gates", &gates},
                       {"slot_rows", &slot_rows}});
  if (d.T * d.k == 0) return;
  dispatch_storage(dy.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    combine_backward_kernel<S><<<grid_for(d.T * d.k), kThreads, 0, stream(ctx)>>>(
        ptr<S>(dyp), ptr<float>(dgates), ptr<S>(dy), ptr<S>(yp), ptr<float>(gates), ptr<int32_t>(slot_rows),
        d.T * d.k, d.k, d.d);
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace xirang::cuda
