// CPU rotary embeddings: the frequency rule (shared with CUDA, which takes
// its frequencies from rope_frequencies), the table, and the rotation.
#include "kernels/rope.h"

#include <cmath>
#include <numbers>

#include "kernels/cpu/common.h"
#include "kernels/rope_checks.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::load;
using cpu::store;
using rope_checks::ApplyDims;

std::vector<double> rope_frequencies(const RopeConfig& cfg, int64_t head_dim) {
  const char* op = "rope_frequencies";
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail(ErrorKind::Config, op, ": head_dim must be even and positive, got ", head_dim);
  if (!(cfg.theta > 1.0) || !std::isfinite(cfg.theta)) fail(ErrorKind::Config, op, ": rope_theta must be > 1, got ", cfg.theta);
  const RopeScaling& s = cfg.scaling;
  if (s.type == RopeScaling::Type::Llama3) {
    if (!(s.factor > 0)) fail(ErrorKind::Config, op, ": rope_scaling.factor must be > 0, got ", s.factor);
    if (!(s.low_freq_factor > 0) || !(s.high_freq_factor > s.low_freq_factor))
      fail(ErrorKind::Config, op, ": rope_scaling needs 0 < low_freq_factor < high_freq_factor, got ",
           s.low_freq_factor, " and ", s.high_freq_factor);
    if (!(s.original_max_position_embeddings > 0))
      fail(ErrorKind::Config, op, ": rope_scaling.original_max_position_embeddings must be > 0, got ",
           s.original_max_position_embeddings);
  }
  const int64_t half = head_dim / 2;
  std::vector<double> freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    // transformers: 1 / base^(arange(0, D, 2) / D) (there in float32).
    double f = 1.0 / std::pow(cfg.theta, double(2 * i) / double(head_dim));
    if (s.type == RopeScaling::Type::Llama3) {
      const double wavelen = 2 * std::numbers::pi / f;
      const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;   // longest kept apart
      const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;  // shortest scaled
      if (wavelen > low_wavelen) {
        f = f / s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
    freq[size_t(i)] = f;
  }
  return freq;
}

void rope_table(const KernelContext& ctx, Tensor cos, Tensor sin, const RopeConfig& cfg) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, rope_table(ctx, cos, sin, cfg));
  const char* op = "rope_table";
  cpu::require_cpu(ctx, op);
  const rope_checks::TableDims d = rope_checks::check_table(op, cos, sin);
  if (cos.dtype() != DType::F32 && cos.dtype() != DType::F64)
    fail(ErrorKind::Shape, op, ": cos is ", dtype_name(cos.dtype()), ", expected f32 or f64");
  check_dtype(op, "sin", sin, cos.dtype());
  const std::vector<double> freq = rope_frequencies(cfg, 2 * d.half);
  auto fill = [&](auto tag) {
    using T = decltype(tag);
    T* pc = cos.data<T>();
    T* ps = sin.data<T>();
    for (int64_t p = 0; p < d.positions; ++p)
      for (int64_t i = 0; i < d.half; ++i) {
        const double a = double(p) * freq[size_t(i)];
        pc[p * d.half + i] = T(std::cos(a));
        ps[p * d.half + i] = T(std::sin(a));
      }
  };
  if (cos.dtype() == DType::F64) fill(double{});
  else fill(float{});
}

namespace {

// Rotates heads [0, g.rot_heads) of each row of x (rows, W) by +angle
// (sign 1) or -angle (sign -1).
void rotate(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin, const ApplyDims& g, int sign) {
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using T = compute_t<S>;
    cpu::check_stat_dtype(op, "cos", cos, x.dtype());
    cpu::check_stat_dtype(op, "sin", sin, x.dtype());
    S* px = x.data<S>();
    const T* pc = cos.data<T>();
    const T* ps = sin.data<T>();
    const int64_t half = g.half, D = 2 * half;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < g.rows; ++r) {
      const int64_t p = g.pos(r);
      const T* c = pc + p * half;
      const T* s = ps + p * half;
      for (int64_t h = 0; h < g.rot_heads; ++h) {
        S* head = px + r * g.width + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = load(head[i]), x2 = load(head[i + half]);
          const T si = sign > 0 ? s[i] : -s[i];
          head[i] = store<S>(T(x1 * c[i] - x2 * si));
          head[i + half] = store<S>(T(x2 * c[i] + x1 * si));
        }
      }
    }
  });
}

}  // namespace

void rope_forward(const KernelContext& ctx, Tensor x, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                  int64_t pos_offset) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, rope_forward(ctx, x, cos, sin, seq_len, pos_offset));
  const char* op = "rope_forward";
  cpu::require_cpu(ctx, op);
  rotate(op, x, cos, sin, rope_checks::check_heads(op, x, cos, sin, seq_len, pos_offset), 1);
}

void rope_backward(const KernelContext& ctx, Tensor dx, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                   int64_t pos_offset) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, rope_backward(ctx, dx, cos, sin, seq_len, pos_offset));
  const char* op = "rope_backward";
  cpu::require_cpu(ctx, op);
  rotate(op, dx, cos, sin, rope_checks::check_heads(op, dx, cos, sin, seq_len, pos_offset), -1);
}

void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, int64_t seq_len, int64_t pos_offset) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, rope_qkv_forward(ctx, qkv, cos, sin, n_head, n_kv_head, seq_len, pos_offset));
  const char* op = "rope_qkv_forward";
  cpu::require_cpu(ctx, op);
  rotate(op, qkv, cos, sin, rope_checks::check_qkv(op, qkv, cos, sin, n_head, n_kv_head, seq_len, pos_offset), 1);
}

void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, int64_t seq_len, int64_t pos_offset) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, rope_qkv_backward(ctx, dqkv, cos, sin, n_head, n_kv_head, seq_len, pos_offset));
  const char* op = "rope_qkv_backward";
  cpu::require_cpu(ctx, op);
  rotate(op, dqkv, cos, sin, rope_checks::check_qkv(op, dqkv, cos, sin, n_head, n_kv_head, seq_len, pos_offset), -1);
}

void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, const ContextSplit& split, int rank) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, rope_qkv_forward(ctx, qkv, cos, sin, n_head, n_kv_head, split, rank));
  const char* op = "rope_qkv_forward";
  cpu::require_cpu(ctx, op);
  rotate(op, qkv, cos, sin, rope_checks::check_qkv_context(op, qkv, cos, sin, n_head, n_kv_head, split, rank), 1);
}

void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, const ContextSplit& split, int rank) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, rope_qkv_backward(ctx, dqkv, cos, sin, n_head, n_kv_head, split, rank));
  const char* op = "rope_qkv_backward";
  cpu::require_cpu(ctx, op);
  rotate(op, dqkv, cos, sin, rope_checks::check_qkv_context(op, dqkv, cos, sin, n_head, n_kv_head, split, rank), -1);
}

}  // namespace xirang
