// CUDA elementwise ops, casts and reductions.
//
// Elementwise kernels are grid-stride loops over the flat elements, in
// float, rounding once on store. The sums are two-pass reductions whose grid
// depends on the element count only, so their results repeat bit for bit on
// any GPU. sum_squares and all_finite copy their one value back and wait on
// an event recorded after that copy, not on the device; the accumulating
// forms (sum_squares_accumulate, mean_accumulate) leave their result on the
// device and never wait.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "core/device_memory.h"

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/reduce_checks.h"

namespace xirang::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond this; plenty for 132 SMs

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>(kMaxBlocks, std::max<int64_t>(1, blocks_for(n, kThreads)))); }

__device__ __forceinline__ int64_t first_index() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

template <class S>
__global__ void gelu_forward_kernel(S* __restrict__ y, const S* __restrict__ x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = store<S>(gelu_value(load(x[i])));
}

// dx may alias dy: each element is read, then written, by one thread.
template <class S>
__global__ void gelu_backward_kernel(S* dx, const S* dy, const S* __restrict__ x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) dx[i] = store<S>(load(dy[i]) * gelu_grad(load(x[i])));
}

template <class S>
__global__ void add_bias_kernel(S* __restrict__ y, const S* __restrict__ bias, int64_t n, int64_t C) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = store<S>(load(y[i]) + load(bias[i % C]));
}

template <class S>
__global__ void add_kernel(S* out, const S* a, const S* b, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = store<S>(load(a[i]) + load(b[i]));
}

// Rounded once from double, as the CPU's scale does.
template <class S>
__device__ __forceinline__ S store_double(double v);
template <>
__device__ __forceinline__ float store_double<float>(double v) { return __double2float_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 store_double<__nv_bfloat16>(double v) { return __double2bfloat16(v); }
template <>
__device__ __forceinline__ __half store_double<__half>(double v) { return __double2half(v); }

// The CPU's operations: the value times s in double, then one rounding to S,
// so the results agree bit for bit. Memory-bound: double math costs nothing.
template <class S>
__global__ void scale_kernel(S* __restrict__ x, double s, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) x[i] = store_double<S>(double(load(x[i])) * s);
}

template <class I, class O>
__global__ void cast_kernel(O* __restrict__ out, const I* __restrict__ in, int64_t n) {
  // Through float, which holds every f32/bf16/f16 value exactly, so the one
  // rounding is the store's.
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = store<O>(load(in[i]));
}

// ---------------------------------------------------------------- reductions
constexpr int kReduceThreads = 256;
constexpr int64_t kReduceBlocks = 1024;  // at most; the second pass is one block of this many threads
constexpr int64_t kElemsPerThread = 8;   // before the grid grows to its cap

// Blocks of the first pass: a function of n only (never of the device).
int64_t reduce_blocks(int64_t n) {
  return std::clamp<int64_t>((n + kReduceThreads * kElemsPerThread - 1) / (kReduceThreads * kElemsPerThread), 1,
                             kReduceBlocks);
}

// Tree sum of one value per thread; the result is in sh[0]. Fixed pairing,
// so the order of additions never varies.
template <int kN>
__device__ void block_tree_sum(double* sh) {
  for (int s = kN / 2; s > 0; s /= 2) {
    __syncthreads();
    if (int(threadIdx.x) < s) sh[threadIdx.x] += sh[threadIdx.x + s];
  }
  __syncthreads();
}

// First pass of a sum (kSquare: of squares): one partial per block.
template <class S, bool kSquare>
__global__ void sum_partial_kernel(const S* __restrict__ x, int64_t n, double* __restrict__ partial) {
  __shared__ double sh[kReduceThreads];
  double acc = 0;
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const double v = load(x[i]);
    acc += kSquare ? v * v : v;
  }
  sh[threadIdx.x] = acc;
  block_tree_sum<kReduceThreads>(sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// Second pass: out = (or, accumulating, out +=) the sum of the partials / divisor.
__global__ void sum_partials_kernel(const double* __restrict__ partial, int64_t count, double* __restrict__ out,
                                    bool accumulate, double divisor) {
  __shared__ double sh[kReduceBlocks];
  sh[threadIdx.x] = int64_t(threadIdx.x) < count ? partial[threadIdx.x] : 0.0;
  block_tree_sum<int(kReduceBlocks)>(sh);
  if (threadIdx.x == 0) *out = (accumulate ? *out : 0.0) + sh[0] / divisor;
}

// One chunk of one tensor of a sum_squares_group: at most kGroupChunk elements.
struct SquaresChunk {
  const void* x;  // (n) the group's storage type
  int64_t n;
};
static_assert(sizeof(SquaresChunk) + sizeof(double) <= size_t(kGroupRecordBytes), "squares record outgrew the table");

// First pass of a group: block b writes the sum of squares of chunk b.
template <class S>
__global__ void squares_group_partial_kernel(const SquaresChunk* __restrict__ chunks, double* __restrict__ partial) {
  __shared__ double sh[kReduceThreads];
  const SquaresChunk c = chunks[blockIdx.x];
  const S* x = static_cast<const S*>(c.x);
  double acc = 0;
  for (int64_t i = threadIdx.x; i < c.n; i += blockDim.x) {
    const double v = load(x[i]);
    acc += v * v;
  }
  sh[threadIdx.x] = acc;
  block_tree_sum<kReduceThreads>(sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// Second pass, one block of kReduceBlocks threads: thread t adds partials
// t, t + kReduceBlocks, ... in order, then the fixed tree. out = the total
// (0 without partials).
__global__ void squares_group_total_kernel(const double* __restrict__ partial, int64_t count,
                                           double* __restrict__ out) {
  __shared__ double sh[kReduceBlocks];
  double acc = 0;
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) acc += partial[j];
  sh[threadIdx.x] = acc;
  block_tree_sum<int(kReduceBlocks)>(sh);
  if (threadIdx.x == 0) *out = sh[0];
}

template <class S>
__global__ void non_finite_kernel(const S* __restrict__ x, int64_t n, int* __restrict__ flag) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += grid_stride()) bad |= !isfinite(load(x[i]));
  if (bad) *flag = 1;  // every writer writes the same value
}

// Copies `bytes` from device `src` into host `dst` on the context's stream
// and waits for that copy (and what precedes it on the stream) only.
void copy_back(const KernelContext& ctx, void* dst, const void* src, size_t bytes, const char* op) {
  cudaEvent_t done = nullptr;
  XR_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  cudaError_t rc = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream(ctx));
  if (rc == cudaSuccess) rc = cudaEventRecord(done, stream(ctx));
  if (rc == cudaSuccess) rc = cudaEventSynchronize(done);
  cudaEventDestroy(done);
  if (rc != cudaSuccess) fail(ErrorKind::Library, op, ": reading the result back failed: ", cudaGetErrorString(rc));
}

}  // namespace

void gelu_forward(const KernelContext& ctx, Tensor y, const Tensor& x) {
  const char* op = "gelu_forward";
  require_cuda(ctx, op);
  check_same_shape(op, y, x);
  check_dtype(op, "y", y, x.dtype());
  check_on_device(op, {{"y", &y}, {"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    gelu_forward_kernel<S><<<grid_for(n), kThreads, 0, stream(ctx)>>>(static_cast<S*>(y.raw()),
                                                                     static_cast<const S*>(x.raw()), n);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void gelu_backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x) {
  const char* op = "gelu_backward";
  require_cuda(ctx, op);
  check_same_shape(op, dx, x);
  check_same_shape(op, dy, x);
  check_dtype(op, "dx", dx, x.dtype());
  check_dtype(op, "dy", dy, x.dtype());
  check_on_device(op, {{"dx", &dx}, {"dy", &dy}, {"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    gelu_backward_kernel<S><<<grid_for(n), kThreads, 0, stream(ctx)>>>(
        static_cast<S*>(dx.raw()), static_cast<const S*>(dy.raw()), static_cast<const S*>(x.raw()), n);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void add_bias(const KernelContext& ctx, Tensor y, const Tensor& bias) {
  const char* op = "add_bias";
  require_cuda(ctx, op);
  if (bias.rank() != 1) fail(ErrorKind::Shape, "add_bias: bias must be (C), got ", bias.shape().str());
  const int64_t C = bias.size(0);
  if (y.rank() < 1 || y.size(-1) != C)
    fail(ErrorKind::Shape, "add_bias: y ", y.shape().str(), " does not have rows of width ", C);
  check_dtype(op, "bias", bias, y.dtype());
  check_on_device(op, {{"y", &y}, {"bias", &bias}});
  const int64_t n = y.numel();
  if (n == 0) return;
  dispatch_storage(y.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    add_bias_kernel<S><<<grid_for(n), kThreads, 0, stream(ctx)>>>(static_cast<S*>(y.raw()),
                                                                 static_cast<const S*>(bias.raw()), n, C);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void add(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b) {
  const char* op = "add";
  require_cuda(ctx, op);
  check_same_shape(op, out, a);
  check_same_shape(op, out, b);
  check_dtype(op, "a", a, out.dtype());
  check_dtype(op, "b", b, out.dtype());
  check_on_device(op, {{"out", &out}, {"a", &a}, {"b", &b}});
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_storage(out.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    add_kernel<S><<<grid_for(n), kThreads, 0, stream(ctx)>>>(
        static_cast<S*>(out.raw()), static_cast<const S*>(a.raw()), static_cast<const S*>(b.raw()), n);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void scale(const KernelContext& ctx, Tensor x, double s) {
  const char* op = "scale";
  require_cuda(ctx, op);
  check_on_device(op, {{"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    scale_kernel<S><<<grid_for(n), kThreads, 0, stream(ctx)>>>(static_cast<S*>(x.raw()), s, n);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void zero(const KernelContext& ctx, Tensor x) {
  const char* op = "zero";
  require_cuda(ctx, op);
  check_on_device(op, {{"x", &x}});
  if (x.bytes() == 0) return;
  XR_CUDA_CHECK(cudaMemsetAsync(x.raw(), 0, x.bytes(), stream(ctx)));
}

void cast(const KernelContext& ctx, Tensor out, const Tensor& in) {
  const char* op = "cast";
  require_cuda(ctx, op);
  if (out.numel() != in.numel())
    fail(ErrorKind::Shape, "cast: element counts differ: ", in.shape().str(), " vs ", out.shape().str());
  check_on_device(op, {{"out", &out}, {"in", &in}});
  const int64_t n = in.numel();
  if (n == 0) return;
  if (out.dtype() == in.dtype()) {
    if (out.raw() != in.raw())
      XR_CUDA_CHECK(cudaMemcpyAsync(out.raw(), in.raw(), in.bytes(), cudaMemcpyDeviceToDevice, stream(ctx)));
    return;
  }
  dispatch_storage(in.dtype(), op, [&](auto in_tag) {
    using I = decltype(in_tag);
    dispatch_storage(out.dtype(), op, [&](auto out_tag) {
      using O = decltype(out_tag);
      cast_kernel<I, O><<<grid_for(n), kThreads, 0, stream(ctx)>>>(static_cast<O*>(out.raw()),
                                                                   static_cast<const I*>(in.raw()), n);
    });
  });
  XR_CUDA_LAUNCH_CHECK();
}

// Queues the two-pass sum of x (kSquare: of squares) into *out, which it
// overwrites or (accumulate) adds to, after dividing by `divisor`. The grid
// depends on n only, so the result repeats bit for bit.
template <bool kSquare>
void queue_sum(const KernelContext& ctx, const Tensor& x, double* out, bool accumulate, double divisor,
               const char* op) {
  const int64_t n = x.numel();
  const int64_t blocks = reduce_blocks(n);
  auto* partial = static_cast<double*>(scratch(ctx, align256(blocks * sizeof(double)), op));
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    sum_partial_kernel<S, kSquare><<<unsigned(blocks), kReduceThreads, 0, stream(ctx)>>>(
        static_cast<const S*>(x.raw()), n, partial);
  });
  XR_CUDA_LAUNCH_CHECK();
  sum_partials_kernel<<<1, unsigned(kReduceBlocks), 0, stream(ctx)>>>(partial, blocks, out, accumulate, divisor);
  XR_CUDA_LAUNCH_CHECK();
}

double sum_squares(const KernelContext& ctx, const Tensor& x) {
  const char* op = "sum_squares";
  require_cuda(ctx, op);
  check_on_device(op, {{"x", &x}});
  if (x.numel() == 0) return 0.0;
  // Scratch: the partials, then the result (queue_sum's partials come first).
  const size_t partial_bytes = align256(reduce_blocks(x.numel()) * sizeof(double));
  auto* base = static_cast<char*>(scratch(ctx, partial_bytes + sizeof(double), op));
  auto* result = reinterpret_cast<double*>(base + partial_bytes);
  queue_sum<true>(ctx, x, result, false, 1.0, op);
  double host = 0;
  copy_back(ctx, &host, result, sizeof(double), op);
  return host;
}

void sum_squares_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x) {
  const char* op = "sum_squares_accumulate";
  require_cuda(ctx, op);
  check_on_device(op, {{"acc", &acc}, {"x", &x}});
  reduce_checks::check_accumulate(op, acc, x, false);
  if (x.numel() == 0) return;
  queue_sum<true>(ctx, x, acc.data<double>(), true, 1.0, op);
}

void mean_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x) {
  const char* op = "mean_accumulate";
  require_cuda(ctx, op);
  check_on_device(op, {{"acc", &acc}, {"x", &x}});
  reduce_checks::check_accumulate(op, acc, x, true);
  if (x.numel() == 0) return;
  queue_sum<false>(ctx, x, acc.data<double>(), true, double(x.numel()), op);
}

bool all_finite(const KernelContext& ctx, const Tensor& x) {
  const char* op = "all_finite";
  require_cuda(ctx, op);
  check_on_device(op, {{"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return true;
  auto* flag = static_cast<int*>(scratch(ctx, sizeof(int), op));
  XR_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream(ctx)));
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    non_finite_kernel<S><<<grid_for(n), kThreads, 0, stream(ctx)>>>(static_cast<const S*>(x.raw()), n, flag);
  });
  XR_CUDA_LAUNCH_CHECK();
  int host = 0;
  copy_back(ctx, &host, flag, sizeof(int), op);
  return host == 0;
}

void sum_squares_group(const KernelContext& ctx, Tensor out, const std::vector<Tensor>& xs, GroupTable& table) {
  const char* op = "sum_squares_group";
  require_cuda(ctx, op);
  check_dtype(op, "out", out, DType::F64);
  if (out.numel() != 1) fail(ErrorKind::Shape, op, ": out must hold one element, got ", out.str());
  check_on_device(op, {{"out", &out}, {"table", &table.memory}});
  const DType dt = xs.empty() ? DType::F32 : xs.front().dtype();
  std::vector<uint64_t> key{uint64_t(reinterpret_cast<uintptr_t>(table.memory.raw())), uint64_t(dt)};
  key.reserve(2 * xs.size() + 2);
  for (const Tensor& x : xs) {
    check_dtype(op, "x", x, dt);  // one storage type for the launch
    check_on_device(op, {{"x", &x}});
    key.push_back(uint64_t(reinterpret_cast<uintptr_t>(x.raw())));
    key.push_back(uint64_t(x.numel()));
  }
  // Table memory: the records, then (from the next 256-byte boundary) one partial per chunk.
  auto partials_at = [](int64_t chunks) { return align256(size_t(chunks) * sizeof(SquaresChunk)); };
  if (key != table.key) {
    const size_t es = dtype_size(dt);
    std::vector<SquaresChunk> recs;
    for (const Tensor& x : xs)
      for (int64_t b = 0; b < x.numel(); b += kGroupChunk)
        recs.push_back({static_cast<const char*>(x.raw()) + b * es, std::min(kGroupChunk, x.numel() - b)});
    const size_t need = partials_at(int64_t(recs.size())) + recs.size() * sizeof(double);
    if (need > table.memory.bytes())
      fail(ErrorKind::Memory, op, ": ", recs.size(), " chunks need ", need, " bytes of table but it has ",
           table.memory.bytes(), " (sized by group_table_words for fewer tensors or elements)");
    if (recs.size() > size_t(INT_MAX)) fail(ErrorKind::Shape, op, ": ", recs.size(), " chunks exceed one grid");
    table.key.clear();  // a failed upload leaves no stale key
    if (!recs.empty())
      copy_bytes(table.memory.raw(), Device::CUDA, recs.data(), Device::CPU, recs.size() * sizeof(SquaresChunk),
                 ctx.cuda_stream, true);
    table.key = std::move(key);
    table.chunks = int64_t(recs.size());
  }
  auto* base = static_cast<char*>(table.memory.raw());
  auto* partial = reinterpret_cast<double*>(base + partials_at(table.chunks));
  if (table.chunks > 0) {
    dispatch_storage(dt, op, [&](auto tag) {
      using S = decltype(tag);
      squares_group_partial_kernel<S><<<unsigned(table.chunks), kReduceThreads, 0, stream(ctx)>>>(
          reinterpret_cast<const SquaresChunk*>(base), partial);
    });
    XR_CUDA_LAUNCH_CHECK();
  }
  squares_group_total_kernel<<<1, unsigned(kReduceBlocks), 0, stream(ctx)>>>(partial, table.chunks,
                                                                             out.data<double>());
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace xirang::cuda
