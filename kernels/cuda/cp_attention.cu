// CUDA context-parallel attention (kernels/cp_attention.h), storage S in
// {f32, bf16, f16}, arithmetic and lse in float.
//
// A straightforward reference-grade kernel set: one warp per row, the
// head's D elements spread over the lanes (D <= 128, at most 4 per lane), a
// warp reduction per dot product.
// - forward: a warp per (batch, head, local query row t) walks the keys at
//   positions 0 .. p = split.position(rank, t) with an online softmax.
// - backward, without atomics (so results repeat bit for bit): a warp per
//   (batch, head, local query row) writes dq; a warp per (batch, key/value
//   head, row of kv_all) writes that row's dk and dv by walking every query
//   of the group that attends to it (zero when none does).
// kv_pack and kv_unpack are strided 2-D copies.
#include <algorithm>
#include <climits>

#include "kernels/cp_attention.h"
#include "kernels/cp_attention_checks.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace xirang::cuda {

using cp_attention_checks::CpDims;

namespace {

constexpr int kWarps = 4;  // rows per block
constexpr int kMaxPerLane = 4;
constexpr int kMaxHeadDim = 32 * kMaxPerLane;

struct Geometry {
  int64_t B, T, H, KV, D, W, C, kvw, c;  // local rows T; kv_all (c, B, T, kvw)
  ContextSplit split;
  int rank;
  int64_t P;  // positions the rank's queries reach
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The lane's elements of a D-wide row, widened.
template <class S>
__device__ __forceinline__ void load_lane(const S* row, int64_t D, float (&x)[kMaxPerLane]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int64_t c = lane + 32 * i;
    x[i] = c < D ? load(row[c]) : 0.f;
  }
}

template <class S>
__device__ __forceinline__ void store_lane(S* row, int64_t D, const float (&x)[kMaxPerLane]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int64_t c = lane + 32 * i;
    if (c < D) row[c] = store<S>(x[i]);
  }
}

__device__ __forceinline__ float dot_lane(const float (&a)[kMaxPerLane], const float (&b)[kMaxPerLane]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) s += a[i] * b[i];
  return warp_sum(s);
}

// kv_all's row of position p, batch b.
__device__ __forceinline__ int64_t kv_row(const Geometry& g, int64_t b, int64_t p) {
  int owner;
  const int64_t r = g.split.local_row(p, &owner);
  return (int64_t(owner) * g.B + b) * g.T + r;
}

// Warp w of block x: row index blockIdx.x * kWarps + w of `rows`.
__device__ __forceinline__ int64_t warp_row() { return int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); }

template <class S>
__global__ void __launch_bounds__(32 * kWarps)
    forward_kernel(const Geometry g, const S* __restrict__ qkv, const S* __restrict__ kv, S* __restrict__ out,
                   float* __restrict__ lse) {
  const int64_t row = warp_row();  // (b, h, t)
  if (row >= g.B * g.H * g.T) return;
  const int64_t t = row % g.T, bh = row / g.T, h = bh % g.H, b = bh / g.H, kh = h / (g.H / g.KV);
  const int64_t p = g.split.position(g.rank, t);
  const float scale = rsqrtf(float(g.D));
  float q[kMaxPerLane], k[kMaxPerLane], v[kMaxPerLane], o[kMaxPerLane] = {0.f, 0.f, 0.f, 0.f};
  load_lane(qkv + (b * g.T + t) * g.W + h * g.D, g.D, q);
  float m = -INFINITY, l = 0.f;
  for (int64_t j = 0; j <= p; ++j) {
    const S* kvr = kv + kv_row(g, b, j) * g.kvw;
    load_lane(kvr + kh * g.D, g.D, k);
    load_lane(kvr + (g.KV + kh) * g.D, g.D, v);
    const float s = scale * dot_lane(q, k);
    const float m2 = fmaxf(m, s);
    const float a = expf(m - m2), e = expf(s - m2);
    l = l * a + e;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) o[i] = o[i] * a + e * v[i];
    m = m2;
  }
  const float inv = 1.f / l;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) o[i] *= inv;
  store_lane(out + (b * g.T + t) * g.C + h * g.D, g.D, o);
  if ((threadIdx.x & 31) == 0) lse[bh * g.T + t] = m + logf(l);
}

// delta = dO . O of a query row, in float.
template <class S>
__device__ __forceinline__ float row_delta(const float (&dout)[kMaxPerLane], const S* orow, int64_t D) {
  float o[kMaxPerLane];
  load_lane(orow, D, o);
  return dot_lane(dout, o);
}

template <class S>
__global__ void __launch_bounds__(32 * kWarps)
    backward_dq_kernel(const Geometry g, S* __restrict__ dqkv, const S* __restrict__ dout, const S* __restrict__ qkv,
                       const S* __restrict__ kv, const S* __restrict__ out, const float* __restrict__ lse) {
  const int64_t row = warp_row();
  if (row >= g.B * g.H * g.T) return;
  const int64_t t = row % g.T, bh = row / g.T, h = bh % g.H, b = bh / g.H, kh = h / (g.H / g.KV);
  const int64_t p = g.split.position(g.rank, t);
  const float scale = rsqrtf(float(g.D));
  float q[kMaxPerLane], dO[kMaxPerLane], k[kMaxPerLane], v[kMaxPerLane], dq[kMaxPerLane] = {0.f, 0.f, 0.f, 0.f};
  load_lane(qkv + (b * g.T + t) * g.W + h * g.D, g.D, q);
  load_lane(dout + (b * g.T + t) * g.C + h * g.D, g.D, dO);
  const float delta = row_delta(dO, out + (b * g.T + t) * g.C + h * g.D, g.D);
  const float L = lse[bh * g.T + t];
  for (int64_t j = 0; j <= p; ++j) {
    const S* kvr = kv + kv_row(g, b, j) * g.kvw;
    load_lane(kvr + kh * g.D, g.D, k);
    load_lane(kvr + (g.KV + kh) * g.D, g.D, v);
    const float pr = expf(scale * dot_lane(q, k) - L);
    const float ds = pr * (dot_lane(dO, v) - delta) * scale;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) dq[i] += ds * k[i];
  }
  store_lane(dqkv + (b * g.T + t) * g.W + h * g.D, g.D, dq);
}

// One warp per row (r, b, u) of dkv_all and key/value head kh: the key at
// position pk = split.position(r, u), against every local query row at a
// position >= pk of the group's query heads.
template <class S>
__global__ void __launch_bounds__(32 * kWarps)
    backward_dkv_kernel(const Geometry g, S* __restrict__ dkv, const S* __restrict__ dout, const S* __restrict__ qkv,
                        const S* __restrict__ kv, const S* __restrict__ out, const float* __restrict__ lse) {
  const int64_t row = warp_row();  // ((r, b, u), kh)
  if (row >= g.c * g.B * g.T * g.KV) return;
  const int64_t kh = row % g.KV, kvrow = row / g.KV, u = kvrow % g.T, r = kvrow / (g.T * g.B);
  const int64_t b = (kvrow / g.T) % g.B;
  const int64_t pk = g.split.position(int(r), u);
  const float scale = rsqrtf(float(g.D));
  float k[kMaxPerLane], v[kMaxPerLane], q[kMaxPerLane], dO[kMaxPerLane];
  float dk[kMaxPerLane] = {0.f, 0.f, 0.f, 0.f}, dv[kMaxPerLane] = {0.f, 0.f, 0.f, 0.f};
  if (pk < g.P) {
    const S* kvr = kv + kvrow * g.kvw;
    load_lane(kvr + kh * g.D, g.D, k);
    load_lane(kvr + (g.KV + kh) * g.D, g.D, v);
    const int64_t G = g.H / g.KV;
    for (int64_t h = kh * G; h < (kh + 1) * G; ++h)
      for (int64_t t = 0; t < g.T; ++t) {
        if (g.split.position(g.rank, t) < pk) continue;
        load_lane(qkv + (b * g.T + t) * g.W + h * g.D, g.D, q);
        load_lane(dout + (b * g.T + t) * g.C + h * g.D, g.D, dO);
        const float delta = row_delta(dO, out + (b * g.T + t) * g.C + h * g.D, g.D);
        const float pr = expf(scale * dot_lane(q, k) - lse[(b * g.H + h) * g.T + t]);
        const float ds = pr * (dot_lane(dO, v) - delta) * scale;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
          dv[i] += pr * dO[i];
          dk[i] += ds * q[i];
        }
      }
  }
  S* d = dkv + kvrow * g.kvw;
  store_lane(d + kh * g.D, g.D, dk);
  store_lane(d + (g.KV + kh) * g.D, g.D, dv);
}

Geometry geometry_of(const char* op, const CpDims& cd, const ContextSplit& split, int rank) {
  const auto& d = cd.d;
  if (d.D > kMaxHeadDim) fail(ErrorKind::Shape, op, ": head dim ", d.D, " is over the CUDA kernel's ", kMaxHeadDim);
  return {d.B, d.T, d.H, d.KV, d.D, d.W, d.C, cd.kvw, cd.c, split, rank, split.position(rank, d.T - 1) + 1};
}

unsigned blocks_of(const char* op, int64_t rows) {
  const int64_t n = (rows + kWarps - 1) / kWarps;
  if (n > INT_MAX) fail(ErrorKind::Shape, op, ": ", rows, " rows exceed the grid limit");
  return unsigned(n);
}

void copy_columns(const KernelContext& ctx, const Tensor& dst, int64_t dst_ld, int64_t dst_off, const Tensor& src,
                  int64_t src_ld, int64_t src_off, int64_t rows, int64_t width) {
  if (rows == 0 || width == 0) return;
  const size_t es = dtype_size(src.dtype());
  XR_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.raw()) + dst_off * es, dst_ld * es,
                                  static_cast<const char*>(src.raw()) + src_off * es, src_ld * es, width * es,
                                  size_t(rows), cudaMemcpyDeviceToDevice, stream(ctx)));
}

}  // namespace

void cp_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, const Tensor& kv_all,
                          const ContextSplit& split, int rank, int n_head, int n_kv_head) {
  const char* op = "cp_attention_forward";
  require_cuda(ctx, op);
  const CpDims cd = cp_attention_checks::check_dims(op, qkv, kv_all, split, rank, n_head, n_kv_head);
  const auto& d = cd.d;
  check_shape(op, "out", out, {d.B, d.T, d.C});
  check_shape(op, "lse", lse, {d.B, d.H, d.T});
  check_dtype(op, "out", out, qkv.dtype());
  check_dtype(op, "lse", lse, DType::F32);
  check_on_device(op, {{"out", &out}, {"lse", &lse}, {"qkv", &qkv}, {"kv_all", &kv_all}});
  const int64_t rows = d.B * d.H * d.T;
  if (rows == 0) return;
  const Geometry g = geometry_of(op, cd, split, rank);
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    forward_kernel<S><<<blocks_of(op, rows), 32 * kWarps, 0, stream(ctx)>>>(
        g, static_cast<const S*>(qkv.raw()), static_cast<const S*>(kv_all.raw()), static_cast<S*>(out.raw()),
        static_cast<float*>(lse.raw()));
  });
  XR_CUDA_LAUNCH_CHECK();
}

void cp_attention_backward(const KernelContext& ctx, Tensor dqkv, Tensor dkv_all, const Tensor& dout,
                           const Tensor& qkv, const Tensor& kv_all, const Tensor& out, const Tensor& lse,
                           const ContextSplit& split, int rank, int n_head, int n_kv_head) {
  const char* op = "cp_attention_backward";
  require_cuda(ctx, op);
  const CpDims cd = cp_attention_checks::check_dims(op, qkv, kv_all, split, rank, n_head, n_kv_head);
  attention_checks::check_backward_operands(op, cd.d, dqkv, dout, qkv, out, lse);
  check_shape(op, "dkv_all", dkv_all, kv_all.shape());
  check_dtype(op, "dkv_all", dkv_all, qkv.dtype());
  check_dtype(op, "lse", lse, DType::F32);
  check_on_device(op, {{"dqkv", &dqkv}, {"dkv_all", &dkv_all}, {"dout", &dout}, {"qkv", &qkv},
                       {"kv_all", &kv_all}, {"out", &out}, {"lse", &lse}});
  const auto& d = cd.d;
  if (d.B * d.T == 0) return;
  const Geometry g = geometry_of(op, cd, split, rank);
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    const S* pdo = static_cast<const S*>(dout.raw());
    const S* pqkv = static_cast<const S*>(qkv.raw());
    const S* pkv = static_cast<const S*>(kv_all.raw());
    const S* pout = static_cast<const S*>(out.raw());
    const float* plse = static_cast<const float*>(lse.raw());
    backward_dq_kernel<S><<<blocks_of(op, d.B * d.H * d.T), 32 * kWarps, 0, stream(ctx)>>>(
        g, static_cast<S*>(dqkv.raw()), pdo, pqkv, pkv, pout, plse);
    XR_CUDA_LAUNCH_CHECK();
    backward_dkv_kernel<S><<<blocks_of(op, cd.c * d.B * d.T * d.KV), 32 * kWarps, 0, stream(ctx)>>>(
        g, static_cast<S*>(dkv_all.raw()), pdo, pqkv, pkv, pout, plse);
    XR_CUDA_LAUNCH_CHECK();
  });
}

void kv_pack(const KernelContext& ctx, Tensor kv, const Tensor& qkv, int n_head, int n_kv_head) {
  const char* op = "kv_pack";
  require_cuda(ctx, op);
  const auto d = cp_attention_checks::check_kv(op, qkv, kv, n_head, n_kv_head);
  check_on_device(op, {{"kv", &kv}, {"qkv", &qkv}});
  const int64_t kvw = 2 * d.KV * d.D;
  copy_columns(ctx, kv, kvw, 0, qkv, d.W, d.C, d.B * d.T, kvw);
}

void kv_unpack(const KernelContext& ctx, Tensor dqkv, const Tensor& dkv, int n_head, int n_kv_head) {
  const char* op = "kv_unpack";
  require_cuda(ctx, op);
  const auto d = cp_attention_checks::check_kv(op, dqkv, dkv, n_head, n_kv_head);
  check_on_device(op, {{"dqkv", &dqkv}, {"dkv", &dkv}});
  const int64_t kvw = 2 * d.KV * d.D;
  copy_columns(ctx, dqkv, d.W, d.C, dkv, kvw, 0, d.B * d.T, kvw);
}

}  // namespace xirang::cuda
