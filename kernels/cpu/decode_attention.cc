// CPU decode attention (kernels/decode_attention.h). The new keys and values
// are copied into the caches first; then one task per (batch, query head)
// widens its key/value head's cached rows into per-thread scratch and
// computes the rows of its new tokens, each a softmax over the keys up to its
// own position. Each output element is written by one task, so the result
// does not depend on the thread count. The arithmetic follows the flash
// forward of kernels/cpu/attention.cc step by step (scores in the compute
// type, their exponentials summed in double, probabilities times values
// accumulated in the compute type), so a prefill reproduces it.
#include "kernels/decode_attention.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/decode_attention_checks.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using decode_attention_checks::Dims;

namespace {

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

template <class S>
void widen(const S* src, compute_t<S>* dst, int64_t n) {
  if constexpr (is_16bit_v<S>) cpu::load_row(src, dst, n);
  else std::copy(src, src + n, dst);
}

template <class S>
void decode_impl(const Dims& dd, const S* pqkv, S* pk, S* pv, S* pout) {
  using T = compute_t<S>;
  const auto& d = dd.a;
  const int64_t n = d.T, KVD = dd.KVD(), end = dd.pos + n;
  // Append: row t of the new tokens goes to cache position pos + t.
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < d.B * n; ++bt) {
    const int64_t b = bt / n, t = bt % n;
    const S* row = pqkv + bt * d.W;
    const int64_t at = (b * dd.T_max + dd.pos + t) * KVD;
    std::copy(row + d.k_off(0), row + d.k_off(0) + KVD, pk + at);
    std::copy(row + d.v_off(0), row + d.v_off(0) + KVD, pv + at);
  }
  const T scale = T(1.0 / std::sqrt(double(d.D)));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H, g = d.kv_head(h);
    // k and v of positions [0, end) (end D each), a query row (D), scores (end), an output row (D).
    T* k = cpu::thread_scratch<T, cpu::kScratchA>(size_t(2 * end * d.D + 2 * d.D + end));
    T* v = k + end * d.D;
    T* q = v + end * d.D;
    T* s = q + d.D;
    T* o = s + end;
    for (int64_t j = 0; j < end; ++j) {
      const int64_t at = (b * dd.T_max + j) * KVD + g * d.D;
      widen(pk + at, k + j * d.D, d.D);
      widen(pv + at, v + j * d.D, d.D);
    }
    for (int64_t i = 0; i < n; ++i) {
      widen(pqkv + (b * n + i) * d.W + d.q_off(h), q, d.D);
      const int64_t L = dd.L(i);
      T mx = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        s[j] = scale * dot(q, k + j * d.D, d.D);
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < L; ++j) {
        s[j] = std::exp(s[j] - mx);
        sum += s[j];
      }
      const T inv = T(1.0 / sum);
      std::fill(o, o + d.D, T(0));
      for (int64_t j = 0; j < L; ++j) axpy(s[j] * inv, v + j * d.D, o, d.D);
      S* orow = pout + (b * n + i) * d.C + h * d.D;
      if constexpr (is_16bit_v<S>) cpu::store_row(o, orow, d.D);
      else std::copy(o, o + d.D, orow);
    }
  }
}

}  // namespace

void decode_attention_forward(const KernelContext& ctx, Tensor out, Tensor k_cache, Tensor v_cache, const Tensor& qkv,
                              int64_t pos, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  XR_ON_CUDA(ctx, decode_attention_forward(ctx, out, k_cache, v_cache, qkv, pos, n_head, n_kv_head));
  const char* op = "decode_attention_forward";
  cpu::require_cpu(ctx, op);
  const Dims d = decode_attention_checks::check(op, out, k_cache, v_cache, qkv, pos, n_head, n_kv_head);
  if (d.a.B == 0 || d.a.T == 0) return;
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    decode_impl(d, qkv.data<S>(), k_cache.data<S>(), v_cache.data<S>(), out.data<S>());
  });
}

}  // namespace xirang
