// CUDA softmax cross entropy fused with its gradient, and the three phases
// of the vocabulary-parallel form (max, sums, finish), storage S in {f32,
// bf16, f16}, arithmetic in float. Losses, row maxima and the (N, 2) sums
// are f32 for every storage type (kernels/context.h; CUDA has no f64).
//
// One block per row. The fused kernel reads the row once for the
// statistics, keeping a running (max, sum of exp(x - max)) per thread (the
// online softmax), merges them across the block, and reads the row a second
// time to write the gradient in place; the probabilities are never stored.
// Block reductions combine values in a fixed tree, so results do not vary
// from run to run.
//
// Targets live in device memory and are not checked on the host (that would
// synchronize). A target outside [0, vocab_size) gives a NaN loss, which the
// caller's non-finite check reports; its row's gradient is then the softmax
// alone, and nothing is read or written out of bounds.
#include <math_constants.h>

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace xirang::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// A running softmax normaliser: the largest value seen and the sum of
// exp(x - m) over the values seen.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum push(MaxSum a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.f;  // a.m = -inf: 0 * 0 + 1
    a.m = x;
  } else if (x != -CUDART_INF_F) {  // a -inf logit adds 0; NaN propagates
    a.s += expf(x - a.m);
  }
  return a;
}

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -CUDART_INF_F) return {m, 0.f};  // both still empty
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}
__device__ __forceinline__ float merge_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float merge_sum(float a, float b) { return a + b; }

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int o) { return {shfl_xor(v.m, o), shfl_xor(v.s, o)}; }

// Every thread of the block gets op over the block's values. Called at most
// once per kernel (the shared slots are not reused). Every merge is
// commutative, so all lanes of the butterfly agree bitwise.
template <class T, class Op>
__device__ T block_allreduce(T v, Op op, T identity) {
  __shared__ T warp_part[kWarps];
  __shared__ T total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < kWarps ? warp_part[lane] : identity;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w = op(w, shfl_xor(w, o));
    if (lane == 0) total = w;
  }
  __syncthreads();
  return total;
}

// Fused loss and gradient of one row per block. logits (N, Vp), dlogits
// (N, Vp) or null (may alias logits), losses (N).
template <class S>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* __restrict__ losses, S* dlogits, const S* logits, const int32_t* __restrict__ targets,
                         int64_t Vp, int64_t V, float dloss) {
  const int64_t i = blockIdx.x;
  const S* row = logits + i * Vp;
  const int32_t tgt = targets[i];
  const bool valid = tgt >= 0 && tgt < V;
  // Read before any thread can overwrite the row (the reduction below
  // synchronizes the block before the gradient is written).
  float target_logit = 0.f;
  if (threadIdx.x == 0) target_logit = valid ? load(row[tgt]) : CUDART_NAN_F;
  MaxSum ms{-CUDART_INF_F, 0.f};
  for (int64_t j = threadIdx.x; j < V; j += kThreads) ms = push(ms, load(row[j]));
  ms = block_allreduce(ms, [](MaxSum a, MaxSum b) { return merge(a, b); }, MaxSum{-CUDART_INF_F, 0.f});
  const float logz = ms.m + logf(ms.s);
  if (threadIdx.x == 0) losses[i] = logz - target_logit;
  if (dlogits == nullptr) return;
  S* drow = dlogits + i * Vp;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    float g = expf(load(row[j]) - logz);
    if (j == tgt) g -= 1.f;
    drow[j] = store<S>(g * dloss);
  }
  for (int64_t j = V + threadIdx.x; j < Vp; j += kThreads) drow[j] = store<S>(0.f);
}

// Shard phases: logits (N, Vs); columns [0, n_real) are real vocabulary
// entries, global columns [vocab_begin, vocab_begin + n_real).
template <class S>
__global__ void __launch_bounds__(kThreads)
    shard_max_kernel(float* __restrict__ row_max, const S* __restrict__ logits, int64_t Vs, int64_t n_real) {
  const S* row = logits + int64_t(blockIdx.x) * Vs;
  float mx = -CUDART_INF_F;  // the identity of the Max all-reduce: an empty shard defers to the others
  for (int64_t j = threadIdx.x; j < n_real; j += kThreads) mx = fmaxf(mx, load(row[j]));
  mx = block_allreduce(mx, [](float a, float b) { return merge_max(a, b); }, -CUDART_INF_F);
  if (threadIdx.x == 0) row_max[blockIdx.x] = mx;
}

// sums (N, 2): [sum exp(logit - row_max) over the shard, the target's logit
// if the shard holds it, else 0]; NaN in place of the logit for a target
// outside [0, vocab_size), so the reduced loss is NaN.
template <class S>
__global__ void __launch_bounds__(kThreads)
    shard_sums_kernel(float* __restrict__ sums, const S* __restrict__ logits, const int32_t* __restrict__ targets,
                      const float* __restrict__ row_max, int64_t Vs, int64_t n_real, int64_t vocab_begin,
                      int64_t vocab_size) {
  const int64_t i = blockIdx.x;
  const S* row = logits + i * Vs;
  const float mx = row_max[i];
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < n_real; j += kThreads) s += expf(load(row[j]) - mx);
  s = block_allreduce(s, [](float a, float b) { return merge_sum(a, b); }, 0.f);
  if (threadIdx.x != 0) return;
  const int32_t tgt = targets[i];
  const int64_t t = int64_t(tgt) - vocab_begin;
  float target_logit = 0.f;
  if (tgt < 0 || tgt >= vocab_size)
    target_logit = CUDART_NAN_F;
  else if (t >= 0 && t < n_real)
    target_logit = load(row[t]);
  sums[2 * i] = s;
  sums[2 * i + 1] = target_logit;
}

// losses (N) and this shard's dlogits (N, Vs) from the reduced row_max and
// sums. No reduction: each thread reads then writes its own columns, so
// dlogits may alias logits.
template <class S>
__global__ void __launch_bounds__(kThreads)
    shard_finish_kernel(float* __restrict__ losses, S* dlogits, const S* logits, const int32_t* __restrict__ targets,
                        const float* __restrict__ row_max, const float* __restrict__ sums, int64_t Vs,
                        int64_t n_real, int64_t vocab_begin, float dloss) {
  const int64_t i = blockIdx.x;
  const float logz = logf(sums[2 * i]) + row_max[i];
  if (threadIdx.x == 0) losses[i] = logz - sums[2 * i + 1];
  if (dlogits == nullptr) return;
  const S* row = logits + i * Vs;
  S* drow = dlogits + i * Vs;
  const int64_t t = int64_t(targets[i]) - vocab_begin;  // may lie outside the shard
  for (int64_t j = threadIdx.x; j < n_real; j += kThreads) {
    float g = expf(load(row[j]) - logz);
    if (j == t) g -= 1.f;
    drow[j] = store<S>(g * dloss);
  }
  for (int64_t j = n_real + threadIdx.x; j < Vs; j += kThreads) drow[j] = store<S>(0.f);
}

template <class S>
S* tensor_ptr(const Tensor& t) {  // callers have checked t's dtype against S
  return static_cast<S*>(t.raw());
}

// An f32 (N) vector on the device.
void check_row_vector(const char* op, const char* what, const Tensor& t, int64_t N) {
  check_shape(op, what, t.flat(), {N});
  check_dtype(op, what, t, DType::F32);
  check_on_device(op, {{what, &t}});
}

void check_targets(const char* op, const Tensor& targets, int64_t N) {
  check_shape(op, "targets", targets.flat(), {N});
  check_dtype(op, "targets", targets, DType::I32);
  check_on_device(op, {{"targets", &targets}});
}

// Checks shared by the three shard phases; returns the logits as (N, V_shard).
Tensor check_shard(const char* op, const Tensor& logits, int64_t vocab_begin, int64_t vocab_size) {
  if (logits.rank() < 1) fail(ErrorKind::Shape, op, ": logits must be (N, V_shard), got ", logits.shape().str());
  if (vocab_size <= 0 || vocab_begin < 0)
    fail(ErrorKind::Shape, op, ": vocab_begin ", vocab_begin, " and vocab_size ", vocab_size,
         " must satisfy vocab_begin >= 0 and vocab_size > 0");
  check_on_device(op, {{"logits", &logits}});
  return logits.flat2d();
}

void check_grid_rows(const char* op, int64_t N) {
  if (N > int64_t(0x7fffffff)) fail(ErrorKind::Shape, op, ": ", N, " rows exceed one launch's grid");
}

// Columns of a shard that are real vocabulary entries (see the CPU version).
int64_t real_columns(int64_t vocab_begin, int64_t vocab_size, int64_t shard_width) {
  return std::clamp<int64_t>(vocab_size - vocab_begin, 0, shard_width);
}

}  // namespace

void cross_entropy_forward_backward(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                    const Tensor& targets, int64_t vocab_size, double dloss) {
  const char* op = "cross_entropy";
  require_cuda(ctx, op);
  if (logits.rank() < 1) fail(ErrorKind::Shape, op, ": logits must be (N, Vp), got ", logits.shape().str());
  Tensor l2 = logits.flat2d();
  const int64_t N = l2.size(0), Vp = l2.size(1);
  if (vocab_size <= 0 || vocab_size > Vp)
    fail(ErrorKind::Shape, op, ": vocab_size ", vocab_size, " outside (0, ", Vp, "]");
  check_on_device(op, {{"logits", &logits}});
  check_targets(op, targets, N);
  check_row_vector(op, "losses", losses, N);
  if (dlogits.defined()) {
    check_same_shape(op, dlogits, logits);
    check_dtype(op, "dlogits", dlogits, logits.dtype());
    check_on_device(op, {{"dlogits", &dlogits}});
  }
  check_grid_rows(op, N);
  if (N == 0) return;
  dispatch_storage(logits.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    cross_entropy_kernel<S><<<unsigned(N), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<float>(losses), tensor_ptr<S>(dlogits), tensor_ptr<S>(logits), tensor_ptr<int32_t>(targets), Vp,
        vocab_size, float(dloss));
  });
  XR_CUDA_LAUNCH_CHECK();
}

void cross_entropy_shard_max(const KernelContext& ctx, Tensor row_max, const Tensor& logits, int64_t vocab_begin,
                             int64_t vocab_size) {
  const char* op = "cross_entropy_shard_max";
  require_cuda(ctx, op);
  Tensor l2 = check_shard(op, logits, vocab_begin, vocab_size);
  const int64_t N = l2.size(0), Vs = l2.size(1), n_real = real_columns(vocab_begin, vocab_size, Vs);
  check_row_vector(op, "row_max", row_max, N);
  check_grid_rows(op, N);
  if (N == 0) return;
  dispatch_storage(logits.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    shard_max_kernel<S>
        <<<unsigned(N), kThreads, 0, stream(ctx)>>>(tensor_ptr<float>(row_max), tensor_ptr<S>(logits), Vs, n_real);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void cross_entropy_shard_sums(const KernelContext& ctx, Tensor sums, const Tensor& logits, const Tensor& targets,
                              const Tensor& row_max, int64_t vocab_begin, int64_t vocab_size) {
  const char* op = "cross_entropy_shard_sums";
  require_cuda(ctx, op);
  Tensor l2 = check_shard(op, logits, vocab_begin, vocab_size);
  const int64_t N = l2.size(0), Vs = l2.size(1), n_real = real_columns(vocab_begin, vocab_size, Vs);
  check_row_vector(op, "row_max", row_max, N);
  check_shape(op, "sums", sums, {N, 2});
  check_dtype(op, "sums", sums, DType::F32);
  check_on_device(op, {{"sums", &sums}});
  check_targets(op, targets, N);
  check_grid_rows(op, N);
  if (N == 0) return;
  dispatch_storage(logits.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    shard_sums_kernel<S><<<unsigned(N), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<float>(sums), tensor_ptr<S>(logits), tensor_ptr<int32_t>(targets), tensor_ptr<float>(row_max), Vs,
        n_real, vocab_begin, vocab_size);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void cross_entropy_shard_finish(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                const Tensor& targets, const Tensor& row_max, const Tensor& sums,
                                int64_t vocab_begin, int64_t vocab_size, double dloss) {
  const char* op = "cross_entropy_shard_finish";
  require_cuda(ctx, op);
  Tensor l2 = check_shard(op, logits, vocab_begin, vocab_size);
  const int64_t N = l2.size(0), Vs = l2.size(1), n_real = real_columns(vocab_begin, vocab_size, Vs);
  check_row_vector(op, "row_max", row_max, N);
  check_row_vector(op, "losses", losses, N);
  check_shape(op, "sums", sums, {N, 2});
  check_dtype(op, "sums", sums, DType::F32);
  check_on_device(op, {{"sums", &sums}});
  check_targets(op, targets, N);
  if (dlogits.defined()) {
    check_same_shape(op, dlogits, logits);
    check_dtype(op, "dlogits", dlogits, logits.dtype());
    check_on_device(op, {{"dlogits", &dlogits}});
  }
  check_grid_rows(op, N);
  if (N == 0) return;
  dispatch_storage(logits.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    shard_finish_kernel<S><<<unsigned(N), kThreads, 0, stream(ctx)>>>(
        tensor_ptr<float>(losses), tensor_ptr<S>(dlogits), tensor_ptr<S>(logits), tensor_ptr<int32_t>(targets),
        tensor_ptr<float>(row_max), tensor_ptr<float>(sums), Vs, n_real, vocab_begin, float(dloss));
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace xirang::cuda
