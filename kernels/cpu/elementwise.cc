// CPU elementwise ops, casts and reductions.
#include "kernels/elementwise.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

namespace {
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
}

void gelu_forward(const KernelContext& ctx, Tensor y, const Tensor& x) {
  cpu::require_cpu(ctx, "gelu_forward");
  check_same_shape("gelu_forward", y, x);
  int64_t n = x.numel();
  dispatch_float(x.dtype(), "gelu_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      T v = px[i];
      py[i] = T(0.5) * v * (T(1) + std::tanh(T(kGeluC) * (v + T(0.044715) * v * v * v)));
    }
  });
}

void gelu_backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x) {
  cpu::require_cpu(ctx, "gelu_backward");
  check_same_shape("gelu_backward", dx, x);
  check_same_shape("gelu_backward", dy, x);
  int64_t n = x.numel();
  dispatch_float(x.dtype(), "gelu_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      T v = px[i];
      T u = T(kGeluC) * (v + T(0.044715) * v * v * v);
      T t = std::tanh(u);
      T du = T(kGeluC) * (T(1) + T(3 * 0.044715) * v * v);
      T grad = T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du;
      pdx[i] = pdy[i] * grad;
    }
  });
}

void add_bias(const KernelContext& ctx, Tensor y, const Tensor& bias) {
  cpu::require_cpu(ctx, "add_bias");
  if (bias.rank() != 1) fail(ErrorKind::Shape, "add_bias: bias must be (C), got ", bias.shape().str());
  const int64_t C = bias.size(0);
  // Any leading dims are rows: (N, C) and (B, T, C) activations alike.
  if (y.rank() < 1 || y.size(-1) != C)
    fail(ErrorKind::Shape, "add_bias: y ", y.shape().str(), " does not have rows of width ", C);
  check_dtype("add_bias", "bias", bias, y.dtype());
  Tensor y2 = y.flat2d();
  const int64_t N = y2.size(0);
  dispatch_float(y.dtype(), "add_bias", [&](auto tag) {
    using T = decltype(tag);
    const T* pb = bias.data<T>();
    T* py = y2.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < C; ++j) py[i * C + j] += pb[j];
  });
}

void add(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b) {
  cpu::require_cpu(ctx, "add");
  check_same_shape("add", out, a);
  check_same_shape("add", out, b);
  int64_t n = out.numel();
  dispatch_float(out.dtype(), "add", [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
  });
}

void scale(const KernelContext& ctx, Tensor x, double s) {
  cpu::require_cpu(ctx, "scale");
  int64_t n = x.numel();
  dispatch_float(x.dtype(), "scale", [&](auto tag) {
    using T = decltype(tag);
    T* p = x.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] = T(p[i] * s);
  });
}

void zero(const KernelContext& ctx, Tensor x) {
  cpu::require_cpu(ctx, "zero");
  std::memset(x.raw(), 0, x.bytes());
}

namespace {

template <class T>
double load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, bf16>) return bf16_to_float(p[i]);
  else if constexpr (std::is_same_v<T, f16>) return f16_to_float(p[i]);
  else return double(p[i]);
}

template <class T>
void store(T* p, int64_t i, double v) {
  if constexpr (std::is_same_v<T, bf16>) p[i] = float_to_bf16(float(v));
  else if constexpr (std::is_same_v<T, f16>) p[i] = float_to_f16(float(v));
  else p[i] = T(v);
}

template <class F>
void dispatch_storage(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::BF16: f(bf16{}); break;
    case DType::F16: f(f16{}); break;
    default: fail(ErrorKind::Shape, op, ": dtype ", dtype_name(t), " is not a float type");
  }
}

}  // namespace

void cast(const KernelContext& ctx, Tensor out, const Tensor& in) {
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
      // A double in between is exact for every pair, so f32 -> bf16 rounds once.
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) store(po, i, load(pi, i));
    });
  });
}

double sum_squares(const KernelContext& ctx, const Tensor& x) {
  cpu::require_cpu(ctx, "sum_squares");
  int64_t n = x.numel();
  double part[cpu::kReduceChunks] = {};
  dispatch_storage(x.dtype(), "sum_squares", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < cpu::kReduceChunks; ++c) {
      double s = 0;
      for (int64_t i = cpu::chunk_begin(n, c); i < cpu::chunk_begin(n, c + 1); ++i) {
        double v = load(p, i);
        s += v * v;
      }
      part[c] = s;
    }
  });
  double total = 0;
  for (double s : part) total += s;
  return total;
}

bool all_finite(const KernelContext& ctx, const Tensor& x) {
  cpu::require_cpu(ctx, "all_finite");
  int64_t n = x.numel();
  int bad = 0;
  dispatch_storage(x.dtype(), "all_finite", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) bad |= !std::isfinite(load(p, i));
  });
  return !bad;
}

}  // namespace xirang
