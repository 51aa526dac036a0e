// CUDA RMSNorm: forward (optionally fused with the residual add before it)
// and backward, storage S in {f32, bf16, f16}, arithmetic in float.
//
// Forward: one warp per row; the sum of squares is a float warp reduction
// (rows are a few thousand elements; the CPU reference sums in double).
//
// Backward is deterministic, as LayerNorm's (kernels/cuda/layernorm.cu):
// each block owns a fixed run of rows, writes dx for them (one warp per
// row) and the column sums of dy * xhat over them into a per-block partial
// row in ctx.blas_workspace; a second kernel adds the partials in a fixed
// order and accumulates into dw. The block count depends only on N, C and
// the workspace size, so results are bitwise reproducible.
#include <algorithm>
#include <cmath>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/rmsnorm.h"

namespace xirang::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;  // rows per block in forward
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int64_t kMinRowsPerBlock = 16;
constexpr int64_t kMaxBackwardBlocks = 1024;
constexpr int kReduceSlices = 8;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// y = RMSNorm(x); with kResidual, x = res = a + b is formed and stored
// first (res may alias a or b: each lane reads a[j] and b[j] before writing
// res[j], and the later pass reads back only the elements the same lane wrote).
template <class S, bool kResidual>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(S* res, S* __restrict__ y, float* __restrict__ rstd, const S* a, const S* b,
                           const S* __restrict__ w, int64_t N, int C, float eps) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const int64_t off = row * C;
  const S* x = a + off;
  float ss = 0.f;
  if constexpr (kResidual) {
    S* r = res + off;
    const S* br = b + off;
    for (int j = lane; j < C; j += 32) {
      const S v = store<S>(load(x[j]) + load(br[j]));  // normalised as stored, as backward sees it
      r[j] = v;
      ss += load(v) * load(v);
    }
    x = r;
  } else {
    for (int j = lane; j < C; j += 32) ss += load(x[j]) * load(x[j]);
  }
  const float rs = 1.f / sqrtf(warp_sum(ss) / float(C) + eps);
  S* yr = y + off;
  for (int j = lane; j < C; j += 32) yr[j] = store<S>((load(x[j]) * rs) * load(w[j]));
  if (lane == 0) rstd[row] = rs;
}

// Block k owns rows [k R, min(N, (k + 1) R)); partial (blocks, C): per
// block, the column sums of dy * xhat, added in row order.
template <class S>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_kernel(S* __restrict__ dx, float* __restrict__ partial, const S* __restrict__ dy,
                            const S* __restrict__ x, const S* __restrict__ w, const float* __restrict__ rstd,
                            int64_t N, int C, int64_t rows_per_block, bool accumulate) {
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  float* pw = partial + int64_t(blockIdx.x) * C;
  for (int j = threadIdx.x; j < C; j += kThreads) {
    float sw = 0.f;
    for (int64_t i = r0; i < r1; ++i) sw += load(dy[i * C + j]) * (load(x[i * C + j]) * rstd[i]);
    pw[j] = sw;
  }
  // dx: one warp per row, dx = rstd (g - xhat mean_j(g xhat)) with g = dy w.
  const int lane = threadIdx.x % 32;
  for (int64_t i = r0 + threadIdx.x / 32; i < r1; i += kWarpsPerBlock) {
    const S* xi = x + i * C;
    const S* dyi = dy + i * C;
    const float rs = rstd[i];
    float sgx = 0.f;
    for (int j = lane; j < C; j += 32) sgx += load(dyi[j]) * load(w[j]) * (load(xi[j]) * rs);
    sgx = warp_sum(sgx) / float(C);
    S* dxi = dx + i * C;
    for (int j = lane; j < C; j += 32) {
      const float v = rs * (load(dyi[j]) * load(w[j]) - (load(xi[j]) * rs) * sgx);
      dxi[j] = store<S>(accumulate ? load(dxi[j]) + v : v);
    }
  }
}

// dw[j] += sum_k partial[k][j]: block (32, kReduceSlices), x one of 32
// adjacent columns, y one of the fixed slices k = y, y + 8, ..., added in order.
template <class G>
__global__ void __launch_bounds__(32 * kReduceSlices)
    rmsnorm_param_reduce_kernel(G* __restrict__ dw, const float* __restrict__ partial, int blocks, int C) {
  __shared__ float acc[kReduceSlices][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (col < C)
    for (int k = threadIdx.y; k < blocks; k += kReduceSlices) s += partial[int64_t(k) * C + col];
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= C) return;
  float t = 0.f;
#pragma unroll
  for (int k = 0; k < kReduceSlices; ++k) t += acc[k][threadIdx.x];
  dw[col] = store<G>(load(dw[col]) + t);
}

template <class S>
S* tensor_ptr(const Tensor& t) {
  return static_cast<S*>(t.raw());
}

std::pair<int64_t, int64_t> check_forward(const char* op, const Tensor& y, const Tensor& rstd, const Tensor& x,
                                          const Tensor& w, double eps) {
  if (x.rank() < 1) fail(ErrorKind::Shape, op, ": x must have at least one dimension, got ", x.shape().str());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, y, x);
  check_shape(op, "w", w, {C});
  check_shape(op, "rstd", rstd.flat(), {N});
  check_dtype(op, "y", y, x.dtype());
  check_dtype(op, "w", w, x.dtype());
  check_dtype(op, "rstd", rstd, DType::F32);  // no f64 path on CUDA: f32 for every storage type
  if (!(eps >= 0) || !std::isfinite(eps)) fail(ErrorKind::Shape, op, ": eps must be finite and >= 0, got ", eps);
  check_on_device(op, {{"y", &y}, {"rstd", &rstd}, {"x", &x}, {"w", &w}});
  if (C > (int64_t(1) << 30)) fail(ErrorKind::Shape, op, ": rows of ", C, " elements are too wide");
  return {N, C};
}

template <bool kResidual>
void launch_forward(const KernelContext& ctx, const char* op, Tensor res, Tensor y, Tensor rstd, const Tensor& a,
                    const Tensor& b, const Tensor& w, int64_t N, int64_t C, double eps) {
  if (N == 0 || C == 0) return;
  dispatch_storage(a.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    rmsnorm_forward_kernel<S, kResidual><<<blocks_for(N, kWarpsPerBlock), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<S>(res), tensor_ptr<S>(y), tensor_ptr<float>(rstd), tensor_ptr<S>(a), tensor_ptr<S>(b),
        tensor_ptr<S>(w), N, int(C), float(eps));
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace

void rmsnorm_forward(const KernelContext& ctx, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, double eps) {
  const char* op = "rmsnorm_forward";
  require_cuda(ctx, op);
  auto [N, C] = check_forward(op, y, rstd, x, w, eps);
  launch_forward<false>(ctx, op, Tensor(), y, rstd, x, Tensor(), w, N, C, eps);
}

void residual_rmsnorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor rstd, const Tensor& a,
                              const Tensor& b, const Tensor& w, double eps) {
  const char* op = "residual_rmsnorm_forward";
  require_cuda(ctx, op);
  auto [N, C] = check_forward(op, y, rstd, a, w, eps);
  check_same_shape(op, res, a);
  check_same_shape(op, b, a);
  check_dtype(op, "res", res, a.dtype());
  check_dtype(op, "b", b, a.dtype());
  check_on_device(op, {{"res", &res}, {"b", &b}});
  launch_forward<true>(ctx, op, res, y, rstd, a, b, w, N, C, eps);
}

void rmsnorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                      const Tensor& w, const Tensor& rstd, GradMode dx_mode) {
  const char* op = "rmsnorm_backward";
  require_cuda(ctx, op);
  if (x.rank() < 1) fail(ErrorKind::Shape, op, ": x must have at least one dimension, got ", x.shape().str());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, dy, x);
  check_same_shape(op, dx, x);
  check_shape(op, "dw", dw, {C});
  check_shape(op, "w", w, {C});
  check_shape(op, "rstd", rstd.flat(), {N});
  check_dtype(op, "dx", dx, x.dtype());
  check_dtype(op, "dy", dy, x.dtype());
  check_dtype(op, "w", w, x.dtype());
  check_dtype(op, "rstd", rstd, DType::F32);
  if (dw.dtype() != DType::F32 && dw.dtype() != x.dtype())
    fail(ErrorKind::Shape, op, ": dw is ", dtype_name(dw.dtype()), ", expected f32 or the storage dtype ",
         dtype_name(x.dtype()));
  check_on_device(op, {{"dx", &dx}, {"dw", &dw}, {"dy", &dy}, {"x", &x}, {"w", &w}, {"rstd", &rstd}});
  if (C > (int64_t(1) << 30)) fail(ErrorKind::Shape, op, ": rows of ", C, " elements are too wide");
  if (N == 0 || C == 0) return;

  // Partial sums: one (C) float row per block, in the context's workspace.
  const size_t row_bytes = size_t(C) * sizeof(float);
  const int64_t fit = std::max<int64_t>(1, int64_t(ctx.blas_workspace_bytes / row_bytes));
  int64_t blocks = std::min({(N + kMinRowsPerBlock - 1) / kMinRowsPerBlock, kMaxBackwardBlocks, fit});
  const int64_t rows_per_block = (N + blocks - 1) / blocks;
  blocks = (N + rows_per_block - 1) / rows_per_block;
  float* partial = static_cast<float*>(scratch(ctx, size_t(blocks) * row_bytes, op));

  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    rmsnorm_backward_kernel<S><<<unsigned(blocks), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<S>(dx), partial, tensor_ptr<S>(dy), tensor_ptr<S>(x), tensor_ptr<S>(w), tensor_ptr<float>(rstd), N,
        int(C), rows_per_block, dx_mode == GradMode::Accumulate);
    XR_CUDA_LAUNCH_CHECK();
    const dim3 block(32, kReduceSlices);
    const unsigned grid = blocks_for(C, 32);
    if (dw.dtype() == DType::F32)
      rmsnorm_param_reduce_kernel<float><<<grid, block, 0, stream(ctx)>>>(tensor_ptr<float>(dw), partial,
                                                                        int(blocks), int(C));
    else
      rmsnorm_param_reduce_kernel<S><<<grid, block, 0, stream(ctx)>>>(tensor_ptr<S>(dw), partial, int(blocks),
                                                                    int(C));
    XR_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace xirang::cuda
