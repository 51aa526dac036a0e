// CPU causal self-attention. One task per (batch, head): each touches a
// disjoint slice of the outputs, so the parallel loop needs no reductions.
// The loops run inside the OpenMP region rather than calling BLAS there, so
// OpenBLAS's own threads never nest inside ours.
#include "kernels/attention.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

namespace {

struct Dims {
  int64_t B, T, C, H, D;
};

Dims check_dims(const char* op, const Tensor& qkv, int n_head) {
  if (qkv.rank() != 3 || qkv.size(2) % 3 != 0)
    fail(ErrorKind::Shape, op, ": qkv must be (B, T, 3C), got ", qkv.shape().str());
  Dims d{qkv.size(0), qkv.size(1), qkv.size(2) / 3, n_head, 0};
  if (n_head <= 0 || d.C % n_head != 0)
    fail(ErrorKind::Shape, op, ": width ", d.C, " is not divisible by n_head ", n_head);
  d.D = d.C / n_head;
  return d;
}

template <class T>
T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <class T>
void axpy(T alpha, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

void attention_forward(const KernelContext& ctx, Tensor out, Tensor probs, const Tensor& qkv, int n_head) {
  cpu::require_cpu(ctx, "attention_forward");
  Dims d = check_dims("attention_forward", qkv, n_head);
  check_shape("attention_forward", "out", out, {d.B, d.T, d.C});
  check_shape("attention_forward", "probs", probs, {d.B, d.H, d.T, d.T});
  dispatch_float(qkv.dtype(), "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* pqkv = qkv.data<T>();
    T* pout = out.data<T>();
    T* pp = probs.data<T>();
    const T scale = T(1.0 / std::sqrt(double(d.D)));
    const int64_t C3 = 3 * d.C;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
      int64_t b = bh / d.H, h = bh % d.H;
      const T* base = pqkv + b * d.T * C3;
      for (int64_t t = 0; t < d.T; ++t) {
        const T* q = base + t * C3 + h * d.D;
        T* p = pp + (bh * d.T + t) * d.T;
        T mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          p[j] = scale * dot(q, base + j * C3 + d.C + h * d.D, d.D);
          mx = std::max(mx, p[j]);
        }
        T sum = 0;
        for (int64_t j = 0; j <= t; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        T inv = T(1) / sum;
        for (int64_t j = 0; j <= t; ++j) p[j] *= inv;
        std::fill(p + t + 1, p + d.T, T(0));
        T* o = pout + (b * d.T + t) * d.C + h * d.D;
        std::fill(o, o + d.D, T(0));
        for (int64_t j = 0; j <= t; ++j) axpy(p[j], base + j * C3 + 2 * d.C + h * d.D, o, d.D);
      }
    }
  });
}

void attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                        const Tensor& probs, int n_head) {
  cpu::require_cpu(ctx, "attention_backward");
  Dims d = check_dims("attention_backward", qkv, n_head);
  check_same_shape("attention_backward", dqkv, qkv);
  check_shape("attention_backward", "dout", dout, {d.B, d.T, d.C});
  check_shape("attention_backward", "probs", probs, {d.B, d.H, d.T, d.T});
  dispatch_float(qkv.dtype(), "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* pqkv = qkv.data<T>();
    const T* pdo = dout.data<T>();
    const T* pp = probs.data<T>();
    T* pd = dqkv.data<T>();
    const T scale = T(1.0 / std::sqrt(double(d.D)));
    const int64_t C3 = 3 * d.C;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
      int64_t b = bh / d.H, h = bh % d.H;
      const T* base = pqkv + b * d.T * C3;
      T* dbase = pd + b * d.T * C3;
      for (int64_t t = 0; t < d.T; ++t)
        for (int part = 0; part < 3; ++part) {
          T* z = dbase + t * C3 + part * d.C + h * d.D;
          std::fill(z, z + d.D, T(0));
        }
      T* dp = cpu::thread_scratch<T>(size_t(d.T));
      for (int64_t t = 0; t < d.T; ++t) {
        const T* p = pp + (bh * d.T + t) * d.T;
        const T* dot_ = pdo + (b * d.T + t) * d.C + h * d.D;
        const T* q = base + t * C3 + h * d.D;
        T* dq = dbase + t * C3 + h * d.D;
        // dP = dO V^T; dV += P^T dO
        T s = 0;
        for (int64_t j = 0; j <= t; ++j) {
          dp[j] = dot(dot_, base + j * C3 + 2 * d.C + h * d.D, d.D);
          s += p[j] * dp[j];
          axpy(p[j], dot_, dbase + j * C3 + 2 * d.C + h * d.D, d.D);
        }
        // softmax backward: dS = P (dP - sum(P dP)); then dQ = dS K scale, dK += dS^T Q scale
        for (int64_t j = 0; j <= t; ++j) {
          T ds = p[j] * (dp[j] - s) * scale;
          axpy(ds, base + j * C3 + d.C + h * d.D, dq, d.D);
          axpy(ds, q, dbase + j * C3 + d.C + h * d.D, d.D);
        }
      }
    }
  });
}

}  // namespace xirang
