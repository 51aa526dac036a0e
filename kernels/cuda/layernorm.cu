// CUDA LayerNorm: forward (optionally fused with the residual add before it)
// and backward, storage S in {f32, bf16, f16}, arithmetic in float.
//
// Forward: one warp per row. The statistics are two-pass (the mean, then the
// sum of squared deviations from it) rather than E[x^2] - E[x]^2, whose
// cancellation in float loses the variance of rows with a large mean. The
// row is re-read from global memory for each pass; a row is at most a few
// KiB, so the re-reads hit L1.
//
// Backward is deterministic: no float atomics anywhere. Each block owns a
// fixed run of rows; it writes dx for them (one warp per row) and the
// column sums of dy * xhat and dy over them into a per-block partial row in
// ctx.blas_workspace. A second kernel adds the partials in a fixed order
// and accumulates into dw, db. The number of blocks depends only on N, C and
// the workspace size, never on the device, so results are bitwise
// reproducible. The workspace is the one cuBLASLt uses: both are used in
// stream order on ctx.cuda_stream, so they never overlap.
#include <algorithm>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/layernorm.h"

namespace xirang::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;  // rows per block in forward
constexpr int kThreads = 32 * kWarpsPerBlock;
// Backward: rows per block at least this many (so a block's column sums
// amortise its launch), and at most this many blocks (bounds the partials
// and the serial part of the final reduction).
constexpr int64_t kMinRowsPerBlock = 16;
constexpr int64_t kMaxBackwardBlocks = 1024;
// The final reduction splits the partials into this many fixed slices.
constexpr int kReduceSlices = 8;

// All lanes end with the same bitwise value: the butterfly adds the same
// pairs in every lane, and float addition is commutative.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// y = LayerNorm(x); with kResidual, x = res = a + b is formed and stored
// first (res may alias a: each lane reads a[j] before writing res[j], and
// the later passes read back only the elements the same lane wrote).
template <class S, bool kResidual>
__global__ void __launch_bounds__(kThreads)
    layernorm_forward_kernel(S* res, S* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                             const S* a, const S* b, const S* __restrict__ w, const S* __restrict__ bias, int64_t N,
                             int C) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const int64_t off = row * C;
  const S* x = a + off;
  float sum = 0.f;
  if constexpr (kResidual) {
    S* r = res + off;
    const S* br = b + off;
    for (int j = lane; j < C; j += 32) {
      // The normalised value is the stored (rounded) sum, as backward sees it.
      const S v = store<S>(load(x[j]) + load(br[j]));
      r[j] = v;
      sum += load(v);
    }
    x = r;
  } else {
    for (int j = lane; j < C; j += 32) sum += load(x[j]);
  }
  const float m = warp_sum(sum) / float(C);
  float var = 0.f;
  for (int j = lane; j < C; j += 32) {
    const float d = load(x[j]) - m;
    var += d * d;
  }
  const float rs = 1.f / sqrtf(warp_sum(var) / float(C) + float(kLayerNormEps));
  S* yr = y + off;
  for (int j = lane; j < C; j += 32) yr[j] = store<S>((load(x[j]) - m) * rs * load(w[j]) + load(bias[j]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// Block k owns rows [k R, min(N, (k + 1) R)). partial (blocks, 2C): per
// block, the column sums of dy * xhat (dw) then of dy (db), added in row order.
template <class S>
__global__ void __launch_bounds__(kThreads)
    layernorm_backward_kernel(S* __restrict__ dx, float* __restrict__ partial, const S* __restrict__ dy,
                              const S* __restrict__ x, const S* __restrict__ w, const float* __restrict__ mean,
                              const float* __restrict__ rstd, int64_t N, int C, int64_t rows_per_block,
                              bool accumulate) {
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  float* pw = partial + int64_t(blockIdx.x) * 2 * C;
  float* pb = pw + C;
  // Column sums: thread t owns columns t, t + 256, ...; reads are coalesced
  // along the row.
  for (int j = threadIdx.x; j < C; j += kThreads) {
    float sw = 0.f, sb = 0.f;
    for (int64_t i = r0; i < r1; ++i) {
      const float g = load(dy[i * C + j]);
      sw += g * ((load(x[i * C + j]) - mean[i]) * rstd[i]);
      sb += g;
    }
    pw[j] = sw;
    pb[j] = sb;
  }
  // dx: one warp per row. With xhat = (x - mean) rstd and g = dy w,
  // dx = rstd (g - mean_j(g) - xhat mean_j(g xhat)).
  const int lane = threadIdx.x % 32;
  for (int64_t i = r0 + threadIdx.x / 32; i < r1; i += kWarpsPerBlock) {
    const S* xi = x + i * C;
    const S* dyi = dy + i * C;
    const float m = mean[i], rs = rstd[i];
    float sg = 0.f, sgx = 0.f;
    for (int j = lane; j < C; j += 32) {
      const float g = load(dyi[j]) * load(w[j]);
      sg += g;
      sgx += g * ((load(xi[j]) - m) * rs);
    }
    sg = warp_sum(sg) / float(C);
    sgx = warp_sum(sgx) / float(C);
    S* dxi = dx + i * C;
    for (int j = lane; j < C; j += 32) {
      const float xhat = (load(xi[j]) - m) * rs;
      const float v = rs * (load(dyi[j]) * load(w[j]) - sg - xhat * sgx);
      dxi[j] = store<S>(accumulate ? load(dxi[j]) + v : v);
    }
  }
}

// dw[j] += sum_k partial[k][j], db[j] += sum_k partial[k][C + j]. Block
// (32, kReduceSlices): x picks one of 32 adjacent columns of the 2C, y one
// of the fixed slices k = y, y + 8, ...; the slices are then added in
// order, so the sum is the same on every run.
template <class G>
__global__ void __launch_bounds__(32 * kReduceSlices)
    layernorm_param_reduce_kernel(G* __restrict__ dw, G* __restrict__ db, const float* __restrict__ partial,
                                  int blocks, int C) {
  __shared__ float acc[kReduceSlices][33];
  const int col = blockIdx.x * 32 + threadIdx.x;  // in [0, 2C)
  float s = 0.f;
  if (col < 2 * C)
    for (int k = threadIdx.y; k < blocks; k += kReduceSlices) s += partial[int64_t(k) * 2 * C + col];
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= 2 * C) return;
  float t = 0.f;
#pragma unroll
  for (int k = 0; k < kReduceSlices; ++k) t += acc[k][threadIdx.x];
  G* out = col < C ? dw + col : db + (col - C);
  *out = store<G>(load(*out) + t);
}

// The typed device pointer of t; callers have checked t's dtype against S.
template <class S>
S* tensor_ptr(const Tensor& t) {
  return static_cast<S*>(t.raw());
}

// Shape and dtype checks shared by both forwards; returns (N, C).
std::pair<int64_t, int64_t> check_forward(const char* op, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                                          const Tensor& x, const Tensor& w, const Tensor& b) {
  if (x.rank() < 1) fail(ErrorKind::Shape, op, ": x must have at least one dimension, got ", x.shape().str());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, y, x);
  check_shape(op, "w", w, {C});
  check_shape(op, "bias", b, {C});
  check_shape(op, "mean", mean.flat(), {N});
  check_shape(op, "rstd", rstd.flat(), {N});
  check_dtype(op, "y", y, x.dtype());
  check_dtype(op, "w", w, x.dtype());
  check_dtype(op, "bias", b, x.dtype());
  // CUDA has no f64 path, so the saved statistics are f32 for every storage type.
  check_dtype(op, "mean", mean, DType::F32);
  check_dtype(op, "rstd", rstd, DType::F32);
  check_on_device(op, {{"y", &y}, {"mean", &mean}, {"rstd", &rstd}, {"x", &x}, {"w", &w}, {"bias", &b}});
  if (C > (int64_t(1) << 30)) fail(ErrorKind::Shape, op, ": rows of ", C, " elements are too wide");
  return {N, C};
}

template <bool kResidual>
void launch_forward(const KernelContext& ctx, const char* op, Tensor res, Tensor y, Tensor mean, Tensor rstd,
                    const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  dispatch_storage(a.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    layernorm_forward_kernel<S, kResidual><<<blocks_for(N, kWarpsPerBlock), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<S>(res), tensor_ptr<S>(y), tensor_ptr<float>(mean), tensor_ptr<float>(rstd), tensor_ptr<S>(a),
        tensor_ptr<S>(b), tensor_ptr<S>(w), tensor_ptr<S>(bias), N, int(C));
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace

void layernorm_forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b) {
  const char* op = "layernorm_forward";
  require_cuda(ctx, op);
  auto [N, C] = check_forward(op, y, mean, rstd, x, w, b);
  launch_forward<false>(ctx, op, Tensor(), y, mean, rstd, x, Tensor(), w, b, N, C);
}

void residual_layernorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor mean, Tensor rstd,
                                const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias) {
  const char* op = "residual_layernorm_forward";
  require_cuda(ctx, op);
  auto [N, C] = check_forward(op, y, mean, rstd, a, w, bias);
  check_same_shape(op, res, a);
  check_same_shape(op, b, a);
  check_dtype(op, "res", res, a.dtype());
  check_dtype(op, "b", b, a.dtype());
  check_on_device(op, {{"res", &res}, {"b", &b}});
  launch_forward<true>(ctx, op, res, y, mean, rstd, a, b, w, bias, N, C);
}

void layernorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor db, const Tensor& dy, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, GradMode dx_mode) {
  const char* op = "layernorm_backward";
  require_cuda(ctx, op);
  if (x.rank() < 1) fail(ErrorKind::Shape, op, ": x must have at least one dimension, got ", x.shape().str());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape(op, dy, x);
  check_same_shape(op, dx, x);
  check_shape(op, "dw", dw, {C});
  check_shape(op, "db", db, {C});
  check_shape(op, "w", w, {C});
  check_shape(op, "mean", mean.flat(), {N});
  check_shape(op, "rstd", rstd.flat(), {N});
  check_dtype(op, "dx", dx, x.dtype());
  check_dtype(op, "dy", dy, x.dtype());
  check_dtype(op, "w", w, x.dtype());
  check_dtype(op, "mean", mean, DType::F32);
  check_dtype(op, "rstd", rstd, DType::F32);
  if (dw.dtype() != DType::F32 && dw.dtype() != x.dtype())
    fail(ErrorKind::Shape, op, ": dw is ", dtype_name(dw.dtype()), ", expected f32 or the storage dtype ",
         dtype_name(x.dtype()));
  check_dtype(op, "db", db, dw.dtype());
  check_on_device(op, {{"dx", &dx}, {"dw", &dw}, {"db", &db}, {"dy", &dy}, {"x", &x}, {"w", &w}, {"mean", &mean},
                       {"rstd", &rstd}});
  if (C > (int64_t(1) << 30)) fail(ErrorKind::Shape, op, ": rows of ", C, " elements are too wide");
  if (N == 0 || C == 0) return;

  // Partial sums: one (2C) float row per block, in the context's workspace
  // (scratch() fails with a Memory error when even one row does not fit).
  const size_t row_bytes = size_t(2 * C) * sizeof(float);
  const int64_t fit = std::max<int64_t>(1, int64_t(ctx.blas_workspace_bytes / row_bytes));
  int64_t blocks = std::min({(N + kMinRowsPerBlock - 1) / kMinRowsPerBlock, kMaxBackwardBlocks, fit});
  const int64_t rows_per_block = (N + blocks - 1) / blocks;
  blocks = (N + rows_per_block - 1) / rows_per_block;
  float* partial = static_cast<float*>(scratch(ctx, size_t(blocks) * row_bytes, op));

  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    layernorm_backward_kernel<S><<<unsigned(blocks), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<S>(dx), partial, tensor_ptr<S>(dy), tensor_ptr<S>(x), tensor_ptr<S>(w), tensor_ptr<float>(mean),
        tensor_ptr<float>(rstd), N, int(C), rows_per_block, dx_mode == GradMode::Accumulate);
    XR_CUDA_LAUNCH_CHECK();
    const dim3 block(32, kReduceSlices);
    const unsigned grid = blocks_for(2 * C, 32);
    if (dw.dtype() == DType::F32)
      layernorm_param_reduce_kernel<float><<<grid, block, 0, stream(ctx)>>>(tensor_ptr<float>(dw),
                                                                          tensor_ptr<float>(db), partial,
                                                                          int(blocks), int(C));
    else
      layernorm_param_reduce_kernel<S><<<grid, block, 0, stream(ctx)>>>(tensor_ptr<S>(dw), tensor_ptr<S>(db),
                                                                      partial, int(blocks), int(C));
    XR_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace xirang::cuda
