// CUDA token and position embeddings: the sharded pieces of kernels/embedding.h.
//
// Token ids: the CPU reference raises a Data error for an id outside
// [0, vocab_size). Checking that here would need a host synchronization (or a
// sticky device flag nobody reads on the hot path), so on CUDA the ids are
// validated where they are read: the dataset rejects ids outside the
// vocabulary when it reads a shard (runtime/dataset.cc), before they reach
// the device. The kernels stay memory-safe for any id: one outside the
// vocabulary is treated like another shard's token (a zero row forward,
// no gradient backward).
//
// Determinism without float atomics:
// - embedding_lookup_backward sorts (row, token index) pairs by row with a
//   stable radix sort (CUB), so the tokens of one vocabulary row form one run
//   in token order; the block that owns the run's first position adds the
//   run's gradient rows to that table row in that order. Each dwte element
//   has one writer and a fixed order of additions.
// - add_positions_backward: a thread owns one (position, column) element of
//   dwpe and walks the rows at that position (every seq_len-th row) in order.
// Both follow the CPU's summation structure in float: with f32 activations
// the rows are added to the existing gradient one by one, in row order (the
// CPU's additions exactly); with 16-bit activations a row's contributions
// are summed first, in row order, and added to the gradient with one
// rounding (the CPU sums in double).
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/embedding_checks.h"
#include "kernels/row_positions.h"

namespace xirang::cuda {

using namespace embedding_checks;

namespace {

constexpr int kThreads = 256;

// A gradient table is stored in the activations' dtype or in f32.
void check_grad_dtype(const char* op, const char* what, const Tensor& g, DType s) {
  if (g.dtype() != s && g.dtype() != DType::F32)
    fail(ErrorKind::Shape, op, ": ", what, " has dtype ", dtype_name(g.dtype()), " (expected ", dtype_name(s),
         " or f32)");
}

// The shard row of token t, or `none` when the shard does not hold it (or it
// is outside the vocabulary).
__device__ __forceinline__ int64_t shard_row(int32_t t, int64_t vocab_begin, int64_t shard_rows, int64_t vocab_size,
                                             int64_t none) {
  const int64_t r = int64_t(t) - vocab_begin;
  return t >= 0 && t < vocab_size && r >= 0 && r < shard_rows ? r : none;
}

// One block per token row, threads across the row's columns.
template <class S>
__global__ void lookup_kernel(S* __restrict__ out, const int32_t* __restrict__ tokens, const S* __restrict__ wte,
                              int64_t C, int64_t vocab_begin, int64_t shard_rows, int64_t vocab_size) {
  const int64_t i = blockIdx.x;
  const int64_t r = shard_row(tokens[i], vocab_begin, shard_rows, vocab_size, -1);
  S* o = out + i * C;
  if (r < 0) {
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) o[j] = store<S>(0.f);
  } else {
    const S* src = wte + r * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) o[j] = src[j];
  }
}

// Gradients of f32 activations add row by row into the table; those of
// 16-bit activations are summed first and added once.
template <class S>
constexpr bool kInPlace = std::is_same_v<S, float>;

// Sort keys: the shard row, or shard_rows for tokens this shard skips (they
// sort last). Values: the token's index.
__global__ void sort_keys_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ index,
                                 const int32_t* __restrict__ tokens, int64_t n, int64_t vocab_begin,
                                 int64_t shard_rows, int64_t vocab_size) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    keys[i] = uint32_t(shard_row(tokens[i], vocab_begin, shard_rows, vocab_size, shard_rows));
    index[i] = int32_t(i);
  }
}

// Block p owns the run of equal keys that starts at sorted position p.
template <class S, class G>
__global__ void lookup_backward_kernel(G* __restrict__ dwte, const S* __restrict__ dout,
                                       const uint32_t* __restrict__ keys, const int32_t* __restrict__ index,
                                       int64_t n, int64_t C, uint32_t skip) {
  const int64_t p = blockIdx.x;
  const uint32_t r = keys[p];
  if (r == skip || (p > 0 && keys[p - 1] == r)) return;
  G* row = dwte + int64_t(r) * C;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    float acc = kInPlace<S> ? load(row[j]) : 0.f;
    for (int64_t q = p; q < n && keys[q] == r; ++q) acc += load(dout[int64_t(index[q]) * C + j]);
    row[j] = store<G>(kInPlace<S> ? acc : load(row[j]) + acc);
  }
}

template <class S>
__global__ void add_positions_kernel(S* __restrict__ x, const S* __restrict__ wpe, int64_t C, const RowPositions pos) {
  const int64_t i = blockIdx.x;
  const S* p = wpe + pos(i) * C;
  S* o = x + i * C;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) o[j] = store<S>(load(o[j]) + load(p[j]));
}

// Block u owns the rows i of dx with (row_offset + i) % seq_len == u, i0,
// i0 + seq_len, ..., which all read the table row pos(i0).
template <class S, class G>
__global__ void add_positions_backward_kernel(G* __restrict__ dwpe, const S* __restrict__ dx, int64_t n, int64_t C,
                                              const RowPositions pos) {
  const int64_t u = blockIdx.x, seq_len = pos.seq_len;
  const int64_t i0 = ((u - pos.row_offset % seq_len) % seq_len + seq_len) % seq_len;
  if (i0 >= n) return;
  G* row = dwpe + pos(i0) * C;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    float acc = kInPlace<S> ? load(row[j]) : 0.f;
    for (int64_t i = i0; i < n; i += seq_len) acc += load(dx[i * C + j]);
    row[j] = store<G>(kInPlace<S> ? acc : load(row[j]) + acc);
  }
}

int bits_for(uint64_t max_value) {
  int b = 1;
  while (b < 32 && (max_value >> b) != 0) ++b;
  return b;
}

}  // namespace

void embedding_lookup(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                      int64_t vocab_begin, int64_t vocab_size) {
  const char* op = "embedding_lookup";
  require_cuda(ctx, op);
  check_table(op, "wte", wte);
  check_shard(op, vocab_begin, vocab_size);
  check_dtype(op, "tokens", tokens, DType::I32);
  const int64_t N = tokens.numel(), Vs = wte.size(0), C = wte.size(1);
  check_rows(op, "out", out, N, C);
  check_dtype(op, "out", out, wte.dtype());
  check_on_device(op, {{"out", &out}, {"tokens", &tokens}, {"wte", &wte}});
  if (N == 0 || C == 0) return;
  if (N > INT_MAX) fail(ErrorKind::Shape, op, ": ", N, " tokens exceed the grid limit of ", INT_MAX);
  dispatch_storage(wte.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    lookup_kernel<S><<<unsigned(N), kThreads, 0, stream(ctx)>>>(static_cast<S*>(out.raw()),
                                                               static_cast<const int32_t*>(tokens.raw()),
                                                               static_cast<const S*>(wte.raw()), C, vocab_begin, Vs,
                                                               vocab_size);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void embedding_lookup_backward(const KernelContext& ctx, Tensor dwte, const Tensor& dout, const Tensor& tokens,
                               int64_t vocab_begin, int64_t vocab_size) {
  const char* op = "embedding_lookup_backward";
  require_cuda(ctx, op);
  check_table(op, "dwte", dwte);
  check_shard(op, vocab_begin, vocab_size);
  check_dtype(op, "tokens", tokens, DType::I32);
  const int64_t N = tokens.numel(), Vs = dwte.size(0), C = dwte.size(1);
  check_rows(op, "dout", dout, N, C);
  check_grad_dtype(op, "dwte", dwte, dout.dtype());
  check_on_device(op, {{"dwte", &dwte}, {"dout", &dout}, {"tokens", &tokens}});
  if (N == 0 || C == 0) return;
  if (N > INT_MAX || Vs >= int64_t(UINT32_MAX))
    fail(ErrorKind::Shape, op, ": ", N, " tokens or ", Vs, " table rows exceed the 32-bit sort keys");

  // Scratch: keys and indices in, keys and indices out, then CUB's own.
  const size_t vec = align256(size_t(N) * 4);
  size_t cub_bytes = 0;
  const int end_bit = bits_for(uint64_t(Vs));  // keys are in [0, Vs]
  XR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), int(N), 0, end_bit, stream(ctx)));
  auto* base = static_cast<char*>(scratch(ctx, 4 * vec + cub_bytes, op));
  auto* keys_in = reinterpret_cast<uint32_t*>(base);
  auto* index_in = reinterpret_cast<int32_t*>(base + vec);
  auto* keys = reinterpret_cast<uint32_t*>(base + 2 * vec);
  auto* index = reinterpret_cast<int32_t*>(base + 3 * vec);
  void* cub_temp = base + 4 * vec;

  const unsigned grid = unsigned(std::min<int64_t>(4096, blocks_for(N, kThreads)));
  sort_keys_kernel<<<grid, kThreads, 0, stream(ctx)>>>(keys_in, index_in, static_cast<const int32_t*>(tokens.raw()),
                                                       N, vocab_begin, Vs, vocab_size);
  XR_CUDA_LAUNCH_CHECK();
  XR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, cub_bytes, keys_in, keys, index_in, index, int(N), 0,
                                                end_bit, stream(ctx)));
  dispatch_storage(dout.dtype(), op, [&](auto stag) {
    using S = decltype(stag);
    dispatch_storage(dwte.dtype(), op, [&](auto gtag) {
      using G = decltype(gtag);
      lookup_backward_kernel<S, G><<<unsigned(N), kThreads, 0, stream(ctx)>>>(
          static_cast<G*>(dwte.raw()), static_cast<const S*>(dout.raw()), keys, index, N, C, uint32_t(Vs));
    });
  });
  XR_CUDA_LAUNCH_CHECK();
}

namespace {

void add_positions_rows(const KernelContext& ctx, const char* op, Tensor x, const Tensor& wpe,
                        const RowPositions& pos) {
  const int64_t C = wpe.size(1);
  if (x.rank() < 1 || x.size(-1) != C)
    fail(ErrorKind::Shape, op, ": x ", x.shape().str(), " does not have rows of width ", C);
  check_dtype(op, "x", x, wpe.dtype());
  check_on_device(op, {{"x", &x}, {"wpe", &wpe}});
  const int64_t N = C == 0 ? 0 : x.numel() / C;
  if (N == 0) return;
  if (N > INT_MAX) fail(ErrorKind::Shape, op, ": ", N, " rows exceed the grid limit of ", INT_MAX);
  dispatch_storage(wpe.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    add_positions_kernel<S><<<unsigned(N), kThreads, 0, stream(ctx)>>>(
        static_cast<S*>(x.raw()), static_cast<const S*>(wpe.raw()), C, pos);
  });
  XR_CUDA_LAUNCH_CHECK();
}

void add_positions_backward_rows(const KernelContext& ctx, const char* op, Tensor dwpe, const Tensor& dx,
                                 const RowPositions& pos) {
  const int64_t C = dwpe.size(1);
  if (dx.rank() < 1 || dx.size(-1) != C)
    fail(ErrorKind::Shape, op, ": dx ", dx.shape().str(), " does not have rows of width ", C);
  check_grad_dtype(op, "dwpe", dwpe, dx.dtype());
  check_on_device(op, {{"dwpe", &dwpe}, {"dx", &dx}});
  const int64_t N = C == 0 ? 0 : dx.numel() / C;
  if (N == 0) return;
  if (pos.seq_len > INT_MAX)
    fail(ErrorKind::Shape, op, ": seq_len ", pos.seq_len, " exceeds the grid limit of ", INT_MAX);
  dispatch_storage(dx.dtype(), op, [&](auto stag) {
    using S = decltype(stag);
    dispatch_storage(dwpe.dtype(), op, [&](auto gtag) {
      using G = decltype(gtag);
      add_positions_backward_kernel<S, G><<<unsigned(pos.seq_len), kThreads, 0, stream(ctx)>>>(
          static_cast<G*>(dwpe.raw()), static_cast<const S*>(dx.raw()), N, C, pos);
    });
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace

void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, int64_t seq_len, int64_t row_offset) {
  const char* op = "add_positions";
  require_cuda(ctx, op);
  check_table(op, "wpe", wpe);
  check_positions(op, "wpe", wpe, wpe.size(1), seq_len, row_offset);
  add_positions_rows(ctx, op, x, wpe, RowPositions::plain(seq_len, row_offset));
}

void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, int64_t seq_len,
                            int64_t row_offset) {
  const char* op = "add_positions_backward";
  require_cuda(ctx, op);
  check_table(op, "dwpe", dwpe);
  check_positions(op, "dwpe", dwpe, dwpe.size(1), seq_len, row_offset);
  add_positions_backward_rows(ctx, op, dwpe, dx, RowPositions::plain(seq_len, row_offset));
}

void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, const ContextSplit& split, int rank,
                   int64_t row_offset) {
  const char* op = "add_positions";
  require_cuda(ctx, op);
  check_table(op, "wpe", wpe);
  check_context_positions(op, "wpe", wpe, split, rank, row_offset);
  add_positions_rows(ctx, op, x, wpe, RowPositions::context(split, rank, row_offset));
}

void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, const ContextSplit& split,
                            int rank, int64_t row_offset) {
  const char* op = "add_positions_backward";
  require_cuda(ctx, op);
  check_table(op, "dwpe", dwpe);
  check_context_positions(op, "dwpe", dwpe, split, rank, row_offset);
  add_positions_backward_rows(ctx, op, dwpe, dx, RowPositions::context(split, rank, row_offset));
}

}  // namespace xirang::cuda
