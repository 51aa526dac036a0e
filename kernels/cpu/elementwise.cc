// CPU elementwise ops, casts and reductions. Every op takes F32, F64, BF16
// and F16; 16-bit values are widened to float, computed on and rounded once
// when stored.
#include "kernels/elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/cpu/vtanh.h"
#include "kernels/reduce_checks.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::load;
using cpu::store;

namespace {
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
}

namespace {

// GELU runs over blocks of kGeluBlock elements: tanh from vtanh.h (a
// float within 1 ulp of the exact tanh, vectorized), then the float
// expression of the scalar form. An element's value depends on its input
// alone, not on the block or thread.
constexpr int64_t kGeluBlock = 512;

template <class S>
void gelu_forward_block(const S* px, S* py, int64_t n) {
  using T = compute_t<S>;
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t i = 0; i < n; ++i) {
      T v = px[i];
      py[i] = T(0.5) * v * (T(1) + std::tanh(T(kGeluC) * (v + T(0.044715) * v * v * v)));
    }
  } else {
    float v[kGeluBlock], t[kGeluBlock];
    double scratch[kGeluBlock];
    cpu::load_row(px, v, n);
    for (int64_t j = 0; j < n; ++j) t[j] = float(kGeluC) * (v[j] + 0.044715f * v[j] * v[j] * v[j]);
    cpu::tanh_floats(t, t, n, scratch);
    for (int64_t j = 0; j < n; ++j) v[j] = 0.5f * v[j] * (1.0f + t[j]);
    cpu::store_row(v, py, n);
  }
}

template <class S>
void gelu_backward_block(const S* px, const S* pdy, S* pdx, int64_t n) {
  using T = compute_t<S>;
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t i = 0; i < n; ++i) {
      T v = px[i];
      T u = T(kGeluC) * (v + T(0.044715) * v * v * v);
      T t = std::tanh(u);
      T du = T(kGeluC) * (T(1) + T(3 * 0.044715) * v * v);
      T grad = T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du;
      pdx[i] = pdy[i] * grad;
    }
  } else {
    float v[kGeluBlock], t[kGeluBlock], d[kGeluBlock];
    double scratch[kGeluBlock];
    cpu::load_row(px, v, n);
    for (int64_t j = 0; j < n; ++j) t[j] = float(kGeluC) * (v[j] + 0.044715f * v[j] * v[j] * v[j]);
    cpu::tanh_floats(t, t, n, scratch);
    cpu::load_row(pdy, d, n);
    for (int64_t j = 0; j < n; ++j) {
      const float du = float(kGeluC) * (1.0f + float(3 * 0.044715) * v[j] * v[j]);
      const float grad = 0.5f * (1.0f + t[j]) + 0.5f * v[j] * (1.0f - t[j] * t[j]) * du;
      d[j] = d[j] * grad;
    }
    cpu::store_row(d, pdx, n);
  }
}

}  // namespace

void gelu_forward(const KernelContext& ctx, Tensor y, const Tensor& x) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, gelu_forward(ctx, y, x));
  cpu::require_cpu(ctx, "gelu_forward");
  check_same_shape("gelu_forward", y, x);
  int64_t n = x.numel();
  check_dtype("gelu_forward", "y", y, x.dtype());
  dispatch_storage(x.dtype(), "gelu_forward", [&](auto tag) {
    using S = decltype(tag);
    const S* px = x.data<S>();
    S* py = y.data<S>();
    const int64_t blocks = (n + kGeluBlock - 1) / kGeluBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = b * kGeluBlock;
      gelu_forward_block(px + i, py + i, std::min(kGeluBlock, n - i));
    }
  });
}

void gelu_backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, gelu_backward(ctx, dx, dy, x));
  cpu::require_cpu(ctx, "gelu_backward");
  check_same_shape("gelu_backward", dx, x);
  check_same_shape("gelu_backward", dy, x);
  int64_t n = x.numel();
  check_dtype("gelu_backward", "dx", dx, x.dtype());
  check_dtype("gelu_backward", "dy", dy, x.dtype());
  dispatch_storage(x.dtype(), "gelu_backward", [&](auto tag) {
    using S = decltype(tag);
    const S* px = x.data<S>();
    const S* pdy = dy.data<S>();
    S* pdx = dx.data<S>();
    const int64_t blocks = (n + kGeluBlock - 1) / kGeluBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = b * kGeluBlock;
      gelu_backward_block(px + i, pdy + i, pdx + i, std::min(kGeluBlock, n - i));
    }
  });
}

void add_bias(const KernelContext& ctx, Tensor y, const Tensor& bias) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, add_bias(ctx, y, bias));
  cpu::require_cpu(ctx, "add_bias");
  if (bias.rank() != 1) fail(ErrorKind::Shape, "add_bias: bias must be (C), got ", bias.shape().str());
  const int64_t C = bias.size(0);
  // Any leading dims are rows: (N, C) and (B, T, C) activations alike.
  if (y.rank() < 1 || y.size(-1) != C)
    fail(ErrorKind::Shape, "add_bias: y ", y.shape().str(), " does not have rows of width ", C);
  check_dtype("add_bias", "bias", bias, y.dtype());
  Tensor y2 = y.flat2d();
  const int64_t N = y2.size(0);
  dispatch_storage(y.dtype(), "add_bias", [&](auto tag) {
    using S = decltype(tag);
    const S* pb = bias.data<S>();
    S* py = y2.data<S>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < C; ++j) py[i * C + j] = store<S>(load(py[i * C + j]) + load(pb[j]));
  });
}

void add(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, add(ctx, out, a, b));
  cpu::require_cpu(ctx, "add");
  check_same_shape("add", out, a);
  check_same_shape("add", out, b);
  int64_t n = out.numel();
  check_dtype("add", "a", a, out.dtype());
  check_dtype("add", "b", b, out.dtype());
  dispatch_storage(out.dtype(), "add", [&](auto tag) {
    using S = decltype(tag);
    const S* pa = a.data<S>();
    const S* pb = b.data<S>();
    S* po = out.data<S>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) po[i] = store<S>(load(pa[i]) + load(pb[i]));
  });
}

void scale(const KernelContext& ctx, Tensor x, double s) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, scale(ctx, x, s));
  cpu::require_cpu(ctx, "scale");
  int64_t n = x.numel();
  // The product is formed in double for every dtype (as F32 always has) and
  // rounded once.
  dispatch_storage(x.dtype(), "scale", [&](auto tag) {
    using S = decltype(tag);
    S* p = x.data<S>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] = store<S>(load(p[i]) * s);
  });
}

void zero(const KernelContext& ctx, Tensor x) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, zero(ctx, x));
  cpu::require_cpu(ctx, "zero");
  char* p = static_cast<char*>(x.raw());
  const size_t bytes = x.bytes();
  // A large fill (the gradient arena, every step) is split over the threads
  // in fixed slices of 32-byte-aligned non-temporal stores: the zeros go to
  // memory without first reading the lines they replace. Below 16 MiB the
  // tensor may stay in the cache for its next use: a plain memset.
  constexpr size_t kSlice = size_t(1) << 20;
  if (bytes < 16 * kSlice) {
    std::memset(p, 0, bytes);
    return;
  }
  const size_t head = (32 - reinterpret_cast<uintptr_t>(p) % 32) % 32;
  std::memset(p, 0, head);
  char* body = p + head;
  const size_t body_bytes = (bytes - head) / 32 * 32;
  std::memset(body + body_bytes, 0, bytes - head - body_bytes);
  const int64_t slices = int64_t((body_bytes + kSlice - 1) / kSlice);
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < slices; ++s) {
    char* b = body + size_t(s) * kSlice;
    char* e = body + std::min(body_bytes, size_t(s + 1) * kSlice);
    const __m256i z = _mm256_setzero_si256();
    for (; b < e; b += 32) _mm256_stream_si256(reinterpret_cast<__m256i*>(b), z);
    _mm_sfence();
  }
}

namespace {

// Widened to double for cast and the reductions: exact for every float dtype.
template <class T>
double load_double(const T* p, int64_t i) {
  return double(cpu::load(p[i]));
}

}  // namespace

void cast(const KernelContext& ctx, Tensor out, const Tensor& in) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, cast(ctx, out, in));
  cpu::require_cpu(ctx, "cast");
  if (out.numel() != in.numel())
    fail(ErrorKind::Shape, "cast: element counts differ: ", in.shape().str(), " vs ", out.shape().str());
  int64_t n = in.numel();
  dispatch_storage(in.dtype(), "cast", [&](auto in_tag) {
    using I = decltype(in_tag);
    dispatch_storage(out.dtype(), "cast", [&](auto out_tag) {
      using O = decltype(out_tag);
      const I* pi = in.data<I>();
      O* po = out.data<O>();
      // A double in between is exact for every source, and store<O>(double)
      // rounds once (f64 -> bf16 included).
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) po[i] = store<O>(load_double(pi, i));
    });
  });
}

namespace {

// sum_squares in fixed chunks of kSquaresChunk elements: within a chunk,
// lane j of 8 takes the elements j, j + 8, ... (the lanes vectorize), and
// the lanes are added in a fixed tree; the chunk sums are added in order.
// The terms and their order depend on n alone, not on the thread count.
constexpr int64_t kSquaresChunk = 1 << 15;

template <class S>
double chunk_sum_squares(const S* p, int64_t n) {
  double lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const double v = load_double(p, i + j);
      lane[j] += v * v;
    }
  for (int j = 0; i < n; ++i, ++j) {
    const double v = load_double(p, i);
    lane[j] += v * v;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace

double sum_squares(const KernelContext& ctx, const Tensor& x) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, sum_squares(ctx, x));
  cpu::require_cpu(ctx, "sum_squares");
  const int64_t n = x.numel();
  const int64_t chunks = (n + kSquaresChunk - 1) / kSquaresChunk;
  double one = 0;
  std::vector<double> many;
  double* part = &one;
  if (chunks > 1) {
    many.assign(size_t(chunks), 0.0);
    part = many.data();
  }
  dispatch_storage(x.dtype(), "sum_squares", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
#pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t b = c * kSquaresChunk;
      part[c] = chunk_sum_squares(p + b, std::min(kSquaresChunk, n - b));
    }
  });
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += part[c];
  return total;
}

bool all_finite(const KernelContext& ctx, const Tensor& x) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, all_finite(ctx, x));
  cpu::require_cpu(ctx, "all_finite");
  int64_t n = x.numel();
  int bad = 0;
  dispatch_storage(x.dtype(), "all_finite", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) bad |= !std::isfinite(load_double(p, i));
  });
  return !bad;
}

void sum_squares_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, sum_squares_accumulate(ctx, acc, x));
  cpu::require_cpu(ctx, "sum_squares_accumulate");
  reduce_checks::check_accumulate("sum_squares_accumulate", acc, x, false);
  acc.data<double>()[0] += sum_squares(ctx, x);
}

void sum_squares_group(const KernelContext& ctx, Tensor out, const std::vector<Tensor>& xs, GroupTable& table) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, sum_squares_group(ctx, out, xs, table));
  cpu::require_cpu(ctx, "sum_squares_group");
  check_dtype("sum_squares_group", "out", out, DType::F64);
  if (out.numel() != 1) fail(ErrorKind::Shape, "sum_squares_group: out must hold one element, got ", out.str());
  double& acc = out.data<double>()[0];
  acc = 0;
  for (const Tensor& x : xs) {
    reduce_checks::check_accumulate("sum_squares_group", out, x, false);
    acc += sum_squares(ctx, x);
  }
}

void mean_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, mean_accumulate(ctx, acc, x));
  cpu::require_cpu(ctx, "mean_accumulate");
  reduce_checks::check_accumulate("mean_accumulate", acc, x, true);
  const int64_t n = x.numel();
  if (n == 0) return;
  // In element order: the per-token losses of a microbatch are few, and one
  // fixed order keeps the step's loss identical on every layout.
  double sum = 0;
  if (x.dtype() == DType::F32) {
    const float* p = x.data<float>();
    for (int64_t i = 0; i < n; ++i) sum += p[i];
  } else {
    const double* p = x.data<double>();
    for (int64_t i = 0; i < n; ++i) sum += p[i];
  }
  acc.data<double>()[0] += sum / double(n);
}

}  // namespace xirang
