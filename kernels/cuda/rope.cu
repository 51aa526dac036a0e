// CUDA rotary embeddings, storage S in {f32, bf16, f16}, table and
// arithmetic in float.
//
// The table is filled on the device from the frequencies the CPU computes
// (rope_frequencies, kernels/cpu/rope.cc), passed by value in the kernel's
// parameters, so both backends use the same doubles; each entry's angle,
// cosine and sine are computed in double there and rounded once to float.
// A one-off at model set-up: nothing waits for it.
//
// The rotation is one thread per pair (x_i, x_{i+D/2}) of a head, in
// place: consecutive threads take consecutive i, so a warp reads and writes
// two contiguous runs of the head.
#include <algorithm>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/rope.h"
#include "kernels/rope_checks.h"

namespace xirang::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHalf = 256;                // head_dim <= 512 (kernel parameters hold the frequencies)
constexpr unsigned kMaxBlocks = 1u << 20;    // grid-stride beyond this

struct Frequencies {
  double f[kMaxHalf];
};

__global__ void __launch_bounds__(kThreads)
    rope_table_kernel(float* __restrict__ cos_out, float* __restrict__ sin_out, const Frequencies freq,
                      int64_t positions, int half) {
  const int64_t total = positions * half;
  for (int64_t k = int64_t(blockIdx.x) * kThreads + threadIdx.x; k < total; k += int64_t(gridDim.x) * kThreads) {
    const int64_t p = k / half;
    const int i = int(k % half);
    double s, c;
    sincos(double(p) * freq.f[i], &s, &c);
    cos_out[k] = float(c);
    sin_out[k] = float(s);
  }
}

// Heads [0, rot_heads) of each row of x (rows, width) rotated by
// sign * angle, row r at position pos(r) (kernels/row_positions.h).
template <class S>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(S* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin, int64_t rows,
                int64_t width, int64_t rot_heads, int half, const RowPositions pos, float sign) {
  const int64_t total = rows * rot_heads * half;
  for (int64_t k = int64_t(blockIdx.x) * kThreads + threadIdx.x; k < total; k += int64_t(gridDim.x) * kThreads) {
    const int i = int(k % half);
    const int64_t t = k / half;
    const int64_t h = t % rot_heads, r = t / rot_heads;
    const int64_t p = pos(r);
    const float c = cos[p * half + i], s = sign * sin[p * half + i];
    S* head = x + r * width + h * 2 * half;
    const float x1 = load(head[i]), x2 = load(head[i + half]);
    head[i] = store<S>(x1 * c - x2 * s);
    head[i + half] = store<S>(x2 * c + x1 * s);
  }
}

unsigned grid_for(int64_t total) {
  return unsigned(std::min<int64_t>(std::max<int64_t>(1, (total + kThreads - 1) / kThreads), kMaxBlocks));
}

void rotate(const KernelContext& ctx, const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin,
            const rope_checks::ApplyDims& d, float sign) {
  check_dtype(op, "cos", cos, DType::F32);  // the table is f32 for every storage type on CUDA
  check_on_device(op, {{"x", &x}, {"cos", &cos}, {"sin", &sin}});
  const int64_t total = d.rows * d.rot_heads * d.half;
  if (total == 0) return;
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    rope_kernel<S><<<grid_for(total), kThreads, 0, stream(ctx)>>>(
        static_cast<S*>(x.raw()), static_cast<const float*>(cos.raw()), static_cast<const float*>(sin.raw()),
        d.rows, d.width, d.rot_heads, int(d.half), d.pos, sign);
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace

void rope_table(const KernelContext& ctx, Tensor cos, Tensor sin, const RopeConfig& cfg) {
  const char* op = "rope_table";
  require_cuda(ctx, op);
  const rope_checks::TableDims d = rope_checks::check_table(op, cos, sin);
  check_dtype(op, "cos", cos, DType::F32);
  check_on_device(op, {{"cos", &cos}, {"sin", &sin}});
  if (d.half > kMaxHalf) fail(ErrorKind::Shape, op, ": head_dim ", 2 * d.half, " is over CUDA's ", 2 * kMaxHalf);
  const std::vector<double> f = rope_frequencies(cfg, 2 * d.half);
  Frequencies freq{};
  std::copy(f.begin(), f.end(), freq.f);
  rope_table_kernel<<<grid_for(d.positions * d.half), kThreads, 0, stream(ctx)>>>(
      static_cast<float*>(cos.raw()), static_cast<float*>(sin.raw()), freq, d.positions, int(d.half));
  XR_CUDA_LAUNCH_CHECK();
}

void rope_forward(const KernelContext& ctx, Tensor x, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                  int64_t pos_offset) {
  const char* op = "rope_forward";
  require_cuda(ctx, op);
  rotate(ctx, op, x, cos, sin, rope_checks::check_heads(op, x, cos, sin, seq_len, pos_offset), 1.f);
}

void rope_backward(const KernelContext& ctx, Tensor dx, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                   int64_t pos_offset) {
  const char* op = "rope_backward";
  require_cuda(ctx, op);
  rotate(ctx, op, dx, cos, sin, rope_checks::check_heads(op, dx, cos, sin, seq_len, pos_offset), -1.f);
}

void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, int64_t seq_len, int64_t pos_offset) {
  const char* op = "rope_qkv_forward";
  require_cuda(ctx, op);
  rotate(ctx, op, qkv, cos, sin, rope_checks::check_qkv(op, qkv, cos, sin, n_head, n_kv_head, seq_len, pos_offset),
         1.f);
}

void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, int64_t seq_len, int64_t pos_offset) {
  const char* op = "rope_qkv_backward";
  require_cuda(ctx, op);
  rotate(ctx, op, dqkv, cos, sin,
         rope_checks::check_qkv(op, dqkv, cos, sin, n_head, n_kv_head, seq_len, pos_offset), -1.f);
}

void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, const ContextSplit& split, int rank) {
  const char* op = "rope_qkv_forward";
  require_cuda(ctx, op);
  rotate(ctx, op, qkv, cos, sin, rope_checks::check_qkv_context(op, qkv, cos, sin, n_head, n_kv_head, split, rank),
         1.f);
}

void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, const ContextSplit& split, int rank) {
  const char* op = "rope_qkv_backward";
  require_cuda(ctx, op);
  rotate(ctx, op, dqkv, cos, sin,
         rope_checks::check_qkv_context(op, dqkv, cos, sin, n_head, n_kv_head, split, rank), -1.f);
}

}  // namespace xirang::cuda
