// CUDA per-head q/k RMSNorm, storage S in {f32, bf16, f16}, arithmetic in
// float, rstd in f32.
//
// Forward: one warp per head of D elements (heads are 64-256 wide: a warp
// row is a few loads per lane); the sum of squares is a float warp
// reduction (the CPU reference sums in double). The v heads of a separate
// out are copied by the same warps.
//
// Backward is deterministic, as rmsnorm's (kernels/cuda/rmsnorm.cu): each
// block owns a fixed run of tokens, writes dqkv for them (one warp per head)
// and, per column of [q_w | k_w], the sum of dout * xhat over its tokens and
// their q (or k) heads into a per-block partial row of 2 D floats in
// ctx.blas_workspace; a second kernel adds the partials in a fixed order and
// accumulates into dq_w and dk_w. The block count depends only on the token
// count, D and the workspace size, so results are bitwise reproducible.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/qk_norm.h"
#include "kernels/qk_norm_checks.h"

namespace xirang::cuda {
namespace {

using qk_norm_checks::Dims;

constexpr int kWarpsPerBlock = 8;  // heads per block in forward
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int64_t kMinTokensPerBlock = 4;  // 4 (H + KV) heads: 40 at Qwen3-8B's H 32, KV 8 over tp 4
constexpr int64_t kMaxBackwardBlocks = 1024;
constexpr int kReduceSlices = 8;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Head row r of `heads` per token (H + KV in place, H + 2 KV with the v
// heads copied): token r / heads, head r % heads. out may be x: each lane
// reads the elements it later writes, and no other lane touches them.
template <class S>
__global__ void __launch_bounds__(kThreads)
    qk_rmsnorm_forward_kernel(S* out, float* __restrict__ rstd, const S* x, const S* __restrict__ qw,
                              const S* __restrict__ kw, int64_t tokens, int heads, int H, int KV, int D, float eps) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= tokens * heads) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const int64_t n = row / heads;
  const int h = int(row % heads);
  const int64_t off = (n * (H + 2 * KV) + h) * D;
  const S* xr = x + off;
  S* yr = out + off;
  if (h >= H + KV) {  // a v head: copied as stored
    for (int j = lane; j < D; j += 32) yr[j] = xr[j];
    return;
  }
  const S* w = h < H ? qw : kw;
  float ss = 0.f;
  for (int j = lane; j < D; j += 32) ss += load(xr[j]) * load(xr[j]);
  const float rs = 1.f / sqrtf(warp_sum(ss) / float(D) + eps);
  for (int j = lane; j < D; j += 32) yr[j] = store<S>((load(xr[j]) * rs) * load(w[j]));
  if (lane == 0) rstd[n * (H + KV) + h] = rs;
}

// Block k owns tokens [k R, min(N, (k + 1) R)); partial (blocks, 2 D): per
// block, column c < D the sum of dy * xhat over its tokens' q heads, column
// D + c over their k heads, added token by token, head by head. dx may be
// dy (Overwrite): no __restrict__ on either, and a barrier between the
// partial sums (which read every row of the block) and the dx writes.
template <class S>
__global__ void __launch_bounds__(kThreads)
    qk_rmsnorm_backward_kernel(S* dx, float* __restrict__ partial, const S* dy, const S* __restrict__ x,
                               const S* __restrict__ qw, const S* __restrict__ kw, const float* __restrict__ rstd,
                               int64_t tokens, int H, int KV, int D, int64_t tokens_per_block, bool accumulate,
                               bool in_place) {
  const int64_t t0 = int64_t(blockIdx.x) * tokens_per_block;
  const int64_t t1 = t0 + tokens_per_block < tokens ? t0 + tokens_per_block : tokens;
  const int heads = H + 2 * KV, normed = H + KV;
  const int64_t width = int64_t(heads) * D;
  float* pw = partial + int64_t(blockIdx.x) * 2 * D;
  for (int col = threadIdx.x; col < 2 * D; col += kThreads) {
    const bool is_k = col >= D;
    const int j = is_k ? col - D : col;
    const int h0 = is_k ? H : 0, h1 = is_k ? normed : H;
    float sw = 0.f;
    for (int64_t i = t0; i < t1; ++i)
      for (int h = h0; h < h1; ++h) {
        const int64_t e = i * width + int64_t(h) * D + j;
        sw += load(dy[e]) * (load(x[e]) * rstd[i * normed + h]);
      }
    pw[col] = sw;
  }
  __syncthreads();
  // dx: one warp per head, dx = rstd (g - xhat mean_j(g xhat)) with g = dy w;
  // a v head's gradient is dy's.
  const int lane = threadIdx.x % 32;
  const int64_t rows = (t1 - t0) * heads;
  for (int64_t r = threadIdx.x / 32; r < rows; r += kWarpsPerBlock) {
    const int64_t i = t0 + r / heads;
    const int h = int(r % heads);
    const int64_t off = i * width + int64_t(h) * D;
    const S* dyi = dy + off;
    S* dxi = dx + off;
    if (h >= normed) {
      if (accumulate)
        for (int j = lane; j < D; j += 32) dxi[j] = store<S>(load(dxi[j]) + load(dyi[j]));
      else if (!in_place)
        for (int j = lane; j < D; j += 32) dxi[j] = dyi[j];
      continue;  // uniform across the warp: h is the warp's
    }
    const S* xi = x + off;
    const S* w = h < H ? qw : kw;
    const float rs = rstd[i * normed + h];
    float sgx = 0.f;
    for (int j = lane; j < D; j += 32) sgx += load(dyi[j]) * load(w[j]) * (load(xi[j]) * rs);
    sgx = warp_sum(sgx) / float(D);
    for (int j = lane; j < D; j += 32) {
      const float v = rs * (load(dyi[j]) * load(w[j]) - (load(xi[j]) * rs) * sgx);
      dxi[j] = store<S>(accumulate ? load(dxi[j]) + v : v);
    }
  }
}

// dw[c] += sum_k partial[k stride + c]: block (32, kReduceSlices), x one of
// 32 adjacent columns, y one of the fixed slices k = y, y + 8, ..., added in
// order (rmsnorm's reduction, with the partial rows 2 D apart).
template <class G>
__global__ void __launch_bounds__(32 * kReduceSlices)
    qk_param_reduce_kernel(G* __restrict__ dw, const float* __restrict__ partial, int blocks, int D, int stride) {
  __shared__ float acc[kReduceSlices][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (col < D)
    for (int k = threadIdx.y; k < blocks; k += kReduceSlices) s += partial[int64_t(k) * stride + col];
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= D) return;
  float t = 0.f;
#pragma unroll
  for (int k = 0; k < kReduceSlices; ++k) t += acc[k][threadIdx.x];
  dw[col] = store<G>(load(dw[col]) + t);
}

template <class S>
S* tensor_ptr(const Tensor& t) {
  return static_cast<S*>(t.raw());
}

// A weight gradient: f32 or the storage dtype.
void check_grad(const char* op, const char* what, const Tensor& dw, DType s) {
  if (dw.dtype() != DType::F32 && dw.dtype() != s)
    fail(ErrorKind::Shape, op, ": ", what, " is ", dtype_name(dw.dtype()), ", expected f32 or the storage dtype ",
         dtype_name(s));
}

template <class S>
void launch_reduce(const KernelContext& ctx, Tensor& dw, const float* partial, int blocks, int D) {
  const dim3 block(32, kReduceSlices);
  const unsigned grid = blocks_for(D, 32);
  if (dw.dtype() == DType::F32)
    qk_param_reduce_kernel<float><<<grid, block, 0, stream(ctx)>>>(tensor_ptr<float>(dw), partial, blocks, D, 2 * D);
  else
    qk_param_reduce_kernel<S><<<grid, block, 0, stream(ctx)>>>(tensor_ptr<S>(dw), partial, blocks, D, 2 * D);
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace

void qk_rmsnorm_forward(const KernelContext& ctx, Tensor out, Tensor rstd, const Tensor& qkv, const Tensor& q_w,
                        const Tensor& k_w, int n_head, int n_kv_head, double eps) {
  const char* op = "qk_rmsnorm_forward";
  require_cuda(ctx, op);
  const Dims d = qk_norm_checks::check_shapes(op, qkv, q_w, k_w, rstd, n_head, n_kv_head);
  check_same_shape(op, out, qkv);
  const DType s = qkv.dtype();
  check_dtype(op, "out", out, s);
  check_dtype(op, "q_w", q_w, s);
  check_dtype(op, "k_w", k_w, s);
  check_dtype(op, "rstd", rstd, DType::F32);  // no f64 path on CUDA: f32 for every storage type
  qk_norm_checks::check_eps(op, eps);
  check_on_device(op, {{"out", &out}, {"rstd", &rstd}, {"qkv", &qkv}, {"q_w", &q_w}, {"k_w", &k_w}});
  // In place, the v heads are already where they belong.
  const int heads = int(qk_norm_checks::same_storage(out, qkv) ? d.normed() : d.H + 2 * d.KV);
  const int64_t rows = d.tokens * heads;
  if (rows == 0) return;
  dispatch_storage(s, op, [&](auto tag) {
    using S = decltype(tag);
    qk_rmsnorm_forward_kernel<S><<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<S>(out), tensor_ptr<float>(rstd), tensor_ptr<S>(qkv), tensor_ptr<S>(q_w), tensor_ptr<S>(k_w),
        d.tokens, heads, int(d.H), int(d.KV), int(d.D), float(eps));
  });
  XR_CUDA_LAUNCH_CHECK();
}

void qk_rmsnorm_backward(const KernelContext& ctx, Tensor dqkv, Tensor dq_w, Tensor dk_w, const Tensor& dout,
                         const Tensor& qkv, const Tensor& q_w, const Tensor& k_w, const Tensor& rstd, int n_head,
                         int n_kv_head, GradMode dx_mode) {
  const char* op = "qk_rmsnorm_backward";
  require_cuda(ctx, op);
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
  check_dtype(op, "rstd", rstd, DType::F32);
  check_grad(op, "dq_w", dq_w, s);
  check_grad(op, "dk_w", dk_w, s);
  const bool accumulate = dx_mode == GradMode::Accumulate;
  qk_norm_checks::check_backward_alias(op, dqkv, dout, accumulate);
  check_on_device(op, {{"dqkv", &dqkv}, {"dq_w", &dq_w}, {"dk_w", &dk_w}, {"dout", &dout}, {"qkv", &qkv},
                       {"q_w", &q_w}, {"k_w", &k_w}, {"rstd", &rstd}});
  const int64_t N = d.tokens, D = d.D;
  if (N == 0) return;

  // Partial sums: one (2 D) float row per block, in the context's workspace.
  const size_t row_bytes = size_t(2 * D) * sizeof(float);
  const int64_t fit = std::max<int64_t>(1, int64_t(ctx.blas_workspace_bytes / row_bytes));
  int64_t blocks = std::min({(N + kMinTokensPerBlock - 1) / kMinTokensPerBlock, kMaxBackwardBlocks, fit});
  const int64_t tokens_per_block = (N + blocks - 1) / blocks;
  blocks = (N + tokens_per_block - 1) / tokens_per_block;
  float* partial = static_cast<float*>(scratch(ctx, size_t(blocks) * row_bytes, op));

  dispatch_storage(s, op, [&](auto tag) {
    using S = decltype(tag);
    qk_rmsnorm_backward_kernel<S><<<unsigned(blocks), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<S>(dqkv), partial, tensor_ptr<S>(dout), tensor_ptr<S>(qkv), tensor_ptr<S>(q_w),
        tensor_ptr<S>(k_w), tensor_ptr<float>(rstd), N, int(d.H), int(d.KV), int(D), tokens_per_block, accumulate,
        qk_norm_checks::same_storage(dqkv, dout));
    XR_CUDA_LAUNCH_CHECK();
    launch_reduce<S>(ctx, dq_w, partial, int(blocks), int(D));
    launch_reduce<S>(ctx, dk_w, partial + D, int(blocks), int(D));
  });
}

}  // namespace xirang::cuda
