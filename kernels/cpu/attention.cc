// CPU causal self-attention. One task per (batch, head), or for the flash
// backward per (batch, key/value head): each touches a disjoint slice of the
// outputs, so the parallel loop needs no reductions and the results do not
// depend on the thread count. The loops run inside the
// OpenMP region rather than calling BLAS there, so OpenBLAS's own threads
// never nest inside ours.
//
// The flash pair with F32, BF16 or F16 storage runs the blocked path
// (namespace blocked below: query blocks as AVX2/FMA matrix products); F64
// and the probability-based pair keep the row-at-a-time loops.
//
//   flash_attention_forward(ctx, out, lse, qkv, n_head, n_kv_head);
//
// A task gathers its head's q, k and v (T rows of D, a qkv row apart) into
// contiguous per-thread scratch in the compute type, accumulates
// the head's gradients there and writes them back at the end, rounding once
// for BF16 and F16; per-thread memory stays O(T D). The flash pair always
// gathers (the contiguous rows are faster); the probability-based pair works
// on F32 and F64 tensors in place, as it always has.
#include "kernels/attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/attention_checks.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/vexpf.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::store;
using attention_checks::check_dims;
using attention_checks::Dims;

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

// Softmax sums of the probability-based pair: F32 and F64 keep summing in
// their own type, as they always have (their results are pinned by golden
// losses); the 16-bit paths sum in double as kernels/context.h asks.
template <class S>
using softmax_sum_t = std::conditional_t<is_16bit_v<S>, double, compute_t<S>>;

// n values widened to the compute type (a copy for F32/F64), and back
// (rounded once for 16-bit).
template <class S>
void widen(const S* src, compute_t<S>* dst, int64_t n) {
  if constexpr (is_16bit_v<S>) cpu::load_row(src, dst, n);
  else std::copy(src, src + n, dst);
}
template <class S>
void narrow(const compute_t<S>* src, S* dst, int64_t n) {
  if constexpr (is_16bit_v<S>) cpu::store_row(src, dst, n);
  else std::copy(src, src + n, dst);
}

// One (batch, head)'s q, k and v rows in the compute type: row t of q is
// q + t * ld; k and v are those of the head's key/value head. Gathered into
// `scratch` (3 T D values) when it is given, else pointing into qkv itself
// (F32/F64 only).
template <class T>
struct Head {
  const T* q;
  const T* k;
  const T* v;
  int64_t ld;
};

// T rows of one D-wide head slice, `ld` apart in src, widened into
// contiguous dst.
template <class S>
void gather(const S* src, int64_t ld, const Dims& d, compute_t<S>* dst) {
  for (int64_t t = 0; t < d.T; ++t) widen(src + t * ld, dst + t * d.D, d.D);
}

template <class S>
Head<compute_t<S>> head_of(const Dims& d, const S* pqkv, int64_t b, int64_t h, compute_t<S>* scratch) {
  const S* base = pqkv + b * d.T * d.W;
  const int64_t g = d.kv_head(h);
  if (scratch) {
    const int64_t TD = d.T * d.D;
    for (int64_t t = 0; t < d.T; ++t) {
      const S* row = base + t * d.W;
      widen(row + d.q_off(h), scratch + t * d.D, d.D);
      widen(row + d.k_off(g), scratch + TD + t * d.D, d.D);
      widen(row + d.v_off(g), scratch + 2 * TD + t * d.D, d.D);
    }
    return {scratch, scratch + TD, scratch + 2 * TD, d.D};
  }
  if constexpr (is_16bit_v<S>) fail(ErrorKind::Internal, "attention: 16-bit q, k, v need scratch");
  else return {base + d.q_off(h), base + d.k_off(g), base + d.v_off(g), d.W};
}

// Gradient rows of one (batch, head) of the probability-based pair (which
// has as many key/value heads as query heads), zeroed: row t of dq is dq + t
// * ld. In `scratch` (3 T D values, see store_grads) when it is given, else
// in dqkv itself (F32/F64 only).
template <class T>
struct HeadGrads {
  T* dq;
  T* dk;
  T* dv;
  int64_t ld;
};

template <class S>
HeadGrads<compute_t<S>> grads_of(const Dims& d, S* pd, int64_t b, int64_t h, compute_t<S>* scratch) {
  using T = compute_t<S>;
  if (scratch) {
    const int64_t TD = d.T * d.D;
    std::fill(scratch, scratch + 3 * TD, T(0));
    return {scratch, scratch + TD, scratch + 2 * TD, d.D};
  }
  if constexpr (is_16bit_v<S>) {
    fail(ErrorKind::Internal, "attention: 16-bit gradients need scratch");
  } else {
    S* base = pd + b * d.T * d.W;
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t off : {d.q_off(h), d.k_off(h), d.v_off(h)})
        std::fill(base + t * d.W + off, base + t * d.W + off + d.D, S(0));
    return {base + d.q_off(h), base + d.k_off(h), base + d.v_off(h), d.W};
  }
}

// T contiguous rows of one head slice written into dqkv at column `off`
// (rounded once for 16-bit).
template <class S>
void scatter(const compute_t<S>* src, const Dims& d, S* pd, int64_t b, int64_t off) {
  S* base = pd + b * d.T * d.W + off;
  for (int64_t t = 0; t < d.T; ++t) narrow(src + t * d.D, base + t * d.W, d.D);
}

// Scratch gradient rows written into dqkv (rounded once for 16-bit).
template <class S>
void store_grads(const Dims& d, const HeadGrads<compute_t<S>>& g, S* pd, int64_t b, int64_t h) {
  scatter<S>(g.dq, d, pd, b, d.q_off(h));
  scatter<S>(g.dk, d, pd, b, d.k_off(h));
  scatter<S>(g.dv, d, pd, b, d.v_off(h));
}

// Per-thread scratch of one task, in the compute type: q, k, v, (backward)
// their gradients, and rows of T and D values.
template <class T>
T* task_scratch(const Dims& d, bool backward) {
  return cpu::thread_scratch<T, cpu::kScratchA>(size_t((backward ? 6 : 3) * d.T * d.D + 2 * d.T + 2 * d.D));
}

// ---------------------------------------------------------------- probability-based pair

// probs of type P: S, or F32 when S is 16-bit.
// Query row t against keys 0..t (causal): e[j] = exp(scale q.k_j - max),
// summed into `sum` (its type sets the accumulation precision); returns the max.
template <class T, class Sum>
T exp_scores(const T* q, const Head<T>& hd, int64_t t, int64_t D, T scale, T* e, Sum& sum) {
  T mx = -INFINITY;
  for (int64_t j = 0; j <= t; ++j) {
    e[j] = scale * dot(q, hd.k + j * hd.ld, D);
    mx = std::max(mx, e[j]);
  }
  for (int64_t j = 0; j <= t; ++j) {
    e[j] = std::exp(e[j] - mx);
    sum += e[j];
  }
  return mx;
}

template <class S, class P>
void attention_forward_impl(const Dims& d, const S* pqkv, S* pout, P* pp) {
  using T = compute_t<S>;
  using Sum = softmax_sum_t<S>;
  const T scale = T(1.0 / std::sqrt(double(d.D)));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    int64_t b = bh / d.H, h = bh % d.H;
    T* scratch = is_16bit_v<S> ? task_scratch<T>(d, false) : nullptr;
    Head<T> hd = head_of(d, pqkv, b, h, scratch);
    T* row_scratch = is_16bit_v<S> ? scratch + 3 * d.T * d.D : nullptr;  // T + D values
    for (int64_t t = 0; t < d.T; ++t) {
      const T* q = hd.q + t * hd.ld;
      P* prow = pp + (bh * d.T + t) * d.T;
      T* p;
      if constexpr (std::is_same_v<P, T>) p = prow;
      else p = row_scratch;
      Sum sum = 0;
      exp_scores(q, hd, t, d.D, scale, p, sum);
      T inv = T(Sum(1) / sum);
      for (int64_t j = 0; j <= t; ++j) p[j] *= inv;
      if constexpr (!std::is_same_v<P, T>) cpu::store_row(p, prow, t + 1);
      std::fill(prow + t + 1, prow + d.T, P{});
      S* orow = pout + (b * d.T + t) * d.C + h * d.D;
      T* o;
      if constexpr (is_16bit_v<S>) o = row_scratch + d.T;
      else o = orow;
      std::fill(o, o + d.D, T(0));
      for (int64_t j = 0; j <= t; ++j) axpy(p[j], hd.v + j * hd.ld, o, d.D);
      if constexpr (is_16bit_v<S>) cpu::store_row(o, orow, d.D);
    }
  }
}

template <class S, class P>
void attention_backward_impl(const Dims& d, S* pd, const S* pdo, const S* pqkv, const P* pp) {
  using T = compute_t<S>;
  using Sum = softmax_sum_t<S>;
  const T scale = T(1.0 / std::sqrt(double(d.D)));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    int64_t b = bh / d.H, h = bh % d.H;
    T* scratch = is_16bit_v<S> ? task_scratch<T>(d, true) : nullptr;
    Head<T> hd = head_of(d, pqkv, b, h, scratch);
    HeadGrads<T> g = grads_of(d, pd, b, h, is_16bit_v<S> ? scratch + 3 * d.T * d.D : nullptr);
    T* dp = cpu::thread_scratch<T>(size_t(2 * d.T + d.D));
    T* p_scratch = dp + d.T;
    T* do_scratch = p_scratch + d.T;
    for (int64_t t = 0; t < d.T; ++t) {
      const P* prow = pp + (bh * d.T + t) * d.T;
      const T* p;
      if constexpr (std::is_same_v<P, T>) {
        p = prow;
      } else {
        cpu::load_row(prow, p_scratch, t + 1);
        p = p_scratch;
      }
      const S* do_row = pdo + (b * d.T + t) * d.C + h * d.D;
      const T* dot_;
      if constexpr (is_16bit_v<S>) {
        cpu::load_row(do_row, do_scratch, d.D);
        dot_ = do_scratch;
      } else {
        dot_ = do_row;
      }
      const T* q = hd.q + t * hd.ld;
      T* dq = g.dq + t * g.ld;
      // dP = dO V^T; dV += P^T dO
      Sum s = 0;
      for (int64_t j = 0; j <= t; ++j) {
        dp[j] = dot(dot_, hd.v + j * hd.ld, d.D);
        s += p[j] * dp[j];
        axpy(p[j], dot_, g.dv + j * g.ld, d.D);
      }
      // softmax backward: dS = P (dP - sum(P dP)); then dQ = dS K scale, dK += dS^T Q scale
      for (int64_t j = 0; j <= t; ++j) {
        T ds = T(p[j] * (dp[j] - s) * scale);
        axpy(ds, hd.k + j * hd.ld, dq, d.D);
        axpy(ds, q, g.dk + j * g.ld, d.D);
      }
    }
    if constexpr (is_16bit_v<S>) store_grads(d, g, pd, b, h);
  }
}

// The probabilities' storage: S, or F32 beside 16-bit activations.
template <class S, class F>
void dispatch_probs(const char* op, const Tensor& probs, F&& f) {
  if (probs.dtype() == dtype_of<S>::value) return f(S{});
  if constexpr (is_16bit_v<S>) {
    if (probs.dtype() == DType::F32) return f(float{});
  }
  fail(ErrorKind::Shape, op, ": probs has dtype ", dtype_name(probs.dtype()), " for ", dtype_name(dtype_of<S>::value),
       " qkv (expected ", dtype_name(dtype_of<S>::value), is_16bit_v<S> ? " or f32)" : ")");
}

}  // namespace

void attention_forward(const KernelContext& ctx, Tensor out, Tensor probs, const Tensor& qkv, int n_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  cpu::require_cpu(ctx, "attention_forward");
  Dims d = check_dims("attention_forward", qkv, n_head);
  check_shape("attention_forward", "out", out, {d.B, d.T, d.C});
  check_shape("attention_forward", "probs", probs, {d.B, d.H, d.T, d.T});
  check_dtype("attention_forward", "out", out, qkv.dtype());
  dispatch_storage(qkv.dtype(), "attention_forward", [&](auto tag) {
    using S = decltype(tag);
    dispatch_probs<S>("attention_forward", probs, [&](auto ptag) {
      using P = decltype(ptag);
      attention_forward_impl(d, qkv.data<S>(), out.data<S>(), probs.data<P>());
    });
  });
}

void attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                        const Tensor& probs, int n_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  cpu::require_cpu(ctx, "attention_backward");
  Dims d = check_dims("attention_backward", qkv, n_head);
  check_same_shape("attention_backward", dqkv, qkv);
  check_shape("attention_backward", "dout", dout, {d.B, d.T, d.C});
  check_shape("attention_backward", "probs", probs, {d.B, d.H, d.T, d.T});
  check_dtype("attention_backward", "dqkv", dqkv, qkv.dtype());
  check_dtype("attention_backward", "dout", dout, qkv.dtype());
  dispatch_storage(qkv.dtype(), "attention_backward", [&](auto tag) {
    using S = decltype(tag);
    dispatch_probs<S>("attention_backward", probs, [&](auto ptag) {
      using P = decltype(ptag);
      attention_backward_impl(d, dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), probs.data<P>());
    });
  });
}

// ---------------------------------------------------------------- flash-style pair
//
// Each query row's scores are computed into one row of scratch (O(T) per
// thread), never stored: forward keeps lse_t = log sum_j exp(s_tj), and
// backward recomputes p_tj = exp(s_tj - lse_t). With delta_t = dO_t . O_t
// (= sum_j p_tj dP_tj), dS_tj = p_tj (dP_tj - delta_t), so backward needs one
// pass over the keys per query and no row of probabilities.

namespace {

template <class S>
void flash_forward_impl(const Dims& d, const S* pqkv, S* pout, compute_t<S>* plse) {
  using T = compute_t<S>;
  const T scale = T(1.0 / std::sqrt(double(d.D)));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    int64_t b = bh / d.H, h = bh % d.H;
    T* scratch = task_scratch<T>(d, false);
    Head<T> hd = head_of(d, pqkv, b, h, scratch);
    T* s = scratch + 3 * d.T * d.D;  // the scores of one row (T), then an output row (D)
    for (int64_t t = 0; t < d.T; ++t) {
      const T* q = hd.q + t * hd.ld;
      double sum = 0;
      const T mx = exp_scores(q, hd, t, d.D, scale, s, sum);
      plse[bh * d.T + t] = T(double(mx) + std::log(sum));
      const T inv = T(1.0 / sum);
      S* orow = pout + (b * d.T + t) * d.C + h * d.D;
      T* o;
      if constexpr (is_16bit_v<S>) o = s + d.T;
      else o = orow;
      std::fill(o, o + d.D, T(0));
      for (int64_t j = 0; j <= t; ++j) axpy(s[j] * inv, hd.v + j * hd.ld, o, d.D);
      if constexpr (is_16bit_v<S>) cpu::store_row(o, orow, d.D);
    }
  }
}

// One task per (batch, key/value head): it walks the query heads that share
// the key/value head, writes each one's dq, and sums their dk and dv (each
// head's own sum in the compute type, the sum over heads in double), so no
// two tasks write the same element. With one query head per key/value head
// this is the multi-head loop, bit for bit.
template <class S>
void flash_backward_impl(const Dims& d, S* pd, const S* pdo, const S* pqkv, const S* pout, const compute_t<S>* plse) {
  using T = compute_t<S>;
  const T scale = T(1.0 / std::sqrt(double(d.D)));
  const int64_t G = d.group(), TD = d.T * d.D;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < d.B * d.KV; ++bg) {
    const int64_t b = bg / d.KV, g = bg % d.KV;
    T* scratch = task_scratch<T>(d, true);
    T* k = scratch;        // (T, D) each: k, v of head g; q of the current query head
    T* v = k + TD;
    T* qh = v + TD;
    T* dq = qh + TD;       // the current query head's gradients
    T* dk = dq + TD;
    T* dv = dk + TD;
    T* do_scratch = dv + TD;
    const S* row0 = pqkv + b * d.T * d.W;
    gather(row0 + d.k_off(g), d.W, d, k);
    gather(row0 + d.v_off(g), d.W, d, v);
    double* acc = G > 1 ? cpu::thread_scratch<double, cpu::kScratchB>(size_t(2 * TD)) : nullptr;  // dk, dv summed
    if (acc) std::fill(acc, acc + 2 * TD, 0.0);
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const int64_t bh = b * d.H + h;
      gather(row0 + d.q_off(h), d.W, d, qh);
      std::fill(dq, dq + 3 * TD, T(0));
      for (int64_t t = 0; t < d.T; ++t) {
        const S* do_row = pdo + (b * d.T + t) * d.C + h * d.D;
        const S* o_row = pout + (b * d.T + t) * d.C + h * d.D;
        double delta = 0;  // dO_t . O_t, a row sum: double
        for (int64_t c = 0; c < d.D; ++c) delta += double(load(do_row[c])) * double(load(o_row[c]));
        const T* dot_;
        if constexpr (is_16bit_v<S>) {
          cpu::load_row(do_row, do_scratch, d.D);
          dot_ = do_scratch;
        } else {
          dot_ = do_row;
        }
        const T* q = qh + t * d.D;
        T* dqt = dq + t * d.D;
        const T lse = plse[bh * d.T + t];
        for (int64_t j = 0; j <= t; ++j) {
          const T p = std::exp(scale * dot(q, k + j * d.D, d.D) - lse);
          const T dp = dot(dot_, v + j * d.D, d.D);
          axpy(p, dot_, dv + j * d.D, d.D);
          const T ds = T(p * (dp - delta) * scale);
          axpy(ds, k + j * d.D, dqt, d.D);
          axpy(ds, q, dk + j * d.D, d.D);
        }
      }
      scatter<S>(dq, d, pd, b, d.q_off(h));
      if (acc)
        for (int64_t i = 0; i < TD; ++i) {
          acc[i] += double(dk[i]);
          acc[TD + i] += double(dv[i]);
        }
    }
    if (acc) {
      S* base = pd + b * d.T * d.W;
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t c = 0; c < d.D; ++c) {
          base[t * d.W + d.k_off(g) + c] = cpu::store<S>(acc[t * d.D + c]);
          base[t * d.W + d.v_off(g) + c] = cpu::store<S>(acc[TD + t * d.D + c]);
        }
    } else {
      scatter<S>(dk, d, pd, b, d.k_off(g));
      scatter<S>(dv, d, pd, b, d.v_off(g));
    }
  }
}

// ---------------------------------------------------------------- blocked F32 compute (F32, BF16, F16)
//
// The F32-compute flash pair works on blocks of kQBlock (32) query rows: the
// block's scores against all the keys it may see (causal: keys 0..last
// row) are one matrix product, its softmax a row pass, its output (or, in
// backward, its dV, dK and dQ contributions) more matrix products. Products
// run on gemm16() below: AVX2/FMA register tiles of 6 x 16, inside the task,
// single-threaded and in a fixed order, so no BLAS threads nest inside
// ours and each task's results depend on the shapes alone. Head rows are
// gathered with width Dp (D rounded up to 16, zero-padded) and key rows
// transposed to (Dp, Tp) with Tp = T rounded up to 16, so every product's
// column count is a multiple of 16; padding contributes exact zeros.
namespace blocked {

constexpr int64_t kQBlock = 32;
constexpr int64_t kMR = 6;

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// C(MR x 16) (+)= A(MR x K) B(K x 16), A(r, k) = A[r rsa + k csa], B row k at B + k ldb.
// The accumulators are named registers (an array of them ends up on the stack).
template <int MR>
inline void tile(int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool accumulate) {
  static_assert(MR >= 1 && MR <= 6);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    const float* a = A + k * csa;
    __m256 x = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    if constexpr (MR > 1) {
      x = _mm256_broadcast_ss(a + rsa);
      c10 = _mm256_fmadd_ps(x, b0, c10);
      c11 = _mm256_fmadd_ps(x, b1, c11);
    }
    if constexpr (MR > 2) {
      x = _mm256_broadcast_ss(a + 2 * rsa);
      c20 = _mm256_fmadd_ps(x, b0, c20);
      c21 = _mm256_fmadd_ps(x, b1, c21);
    }
    if constexpr (MR > 3) {
      x = _mm256_broadcast_ss(a + 3 * rsa);
      c30 = _mm256_fmadd_ps(x, b0, c30);
      c31 = _mm256_fmadd_ps(x, b1, c31);
    }
    if constexpr (MR > 4) {
      x = _mm256_broadcast_ss(a + 4 * rsa);
      c40 = _mm256_fmadd_ps(x, b0, c40);
      c41 = _mm256_fmadd_ps(x, b1, c41);
    }
    if constexpr (MR > 5) {
      x = _mm256_broadcast_ss(a + 5 * rsa);
      c50 = _mm256_fmadd_ps(x, b0, c50);
      c51 = _mm256_fmadd_ps(x, b1, c51);
    }
  }
  auto put = [&](int r, __m256 lo, __m256 hi) {
    float* c = C + r * ldc;
    if (accumulate) {
      lo = _mm256_add_ps(_mm256_loadu_ps(c), lo);
      hi = _mm256_add_ps(_mm256_loadu_ps(c + 8), hi);
    }
    _mm256_storeu_ps(c, lo);
    _mm256_storeu_ps(c + 8, hi);
  };
  put(0, c00, c01);
  if constexpr (MR > 1) put(1, c10, c11);
  if constexpr (MR > 2) put(2, c20, c21);
  if constexpr (MR > 3) put(3, c30, c31);
  if constexpr (MR > 4) put(4, c40, c41);
  if constexpr (MR > 5) put(5, c50, c51);
}

// C(M x N) (+)= A(M x K) B(K x N) with N a multiple of 16; A(i, k) = A[i rsa + k csa]
// (rsa = lda, csa = 1 for A; rsa = 1, csa = lda for a transposed A).
inline void gemm16(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
                   int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < N; j += 16)
    for (int64_t i = 0; i < M; i += kMR) {
      const float* a = A + i * rsa;
      float* c = C + i * ldc + j;
      switch (std::min<int64_t>(kMR, M - i)) {
        case 6: tile<6>(K, a, rsa, csa, B + j, ldb, c, ldc, accumulate); break;
        case 5: tile<5>(K, a, rsa, csa, B + j, ldb, c, ldc, accumulate); break;
        case 4: tile<4>(K, a, rsa, csa, B + j, ldb, c, ldc, accumulate); break;
        case 3: tile<3>(K, a, rsa, csa, B + j, ldb, c, ldc, accumulate); break;
        case 2: tile<2>(K, a, rsa, csa, B + j, ldb, c, ldc, accumulate); break;
        default: tile<1>(K, a, rsa, csa, B + j, ldb, c, ldc, accumulate); break;
      }
    }
}

// T rows of a head slice (`ld` apart in src) as float rows of width Dp, zero-padded.
template <class S>
void gather_rows(const S* src, int64_t ld, int64_t T, int64_t D, int64_t Dp, float* dst) {
  for (int64_t t = 0; t < T; ++t) {
    cpu::load_row(src + t * ld, dst + t * Dp, D);
    std::fill(dst + t * Dp + D, dst + (t + 1) * Dp, 0.f);
  }
}

// Gathered rows (T, Dp) transposed into dst (Dp, Tp), columns T.. zero; in
// 8 x 8 tiles (a row of dst is Tp floats long, often a power of two: column
// at a time would keep hitting the same cache sets).
inline void transpose_rows(const float* src, int64_t T, int64_t Dp, int64_t Tp, float* dst) {
  for (int64_t t0 = 0; t0 < Tp; t0 += 8)
    for (int64_t c0 = 0; c0 < Dp; c0 += 8)
      for (int64_t c = c0; c < c0 + 8; ++c)
        for (int64_t t = t0; t < t0 + 8; ++t) dst[c * Tp + t] = t < T ? src[t * Dp + c] : 0.f;
}

// Row r of a score block (query i = i0 + r sees keys 0..i): s_j <- e^(scale s_j - shift) for j <= i, 0
// for i < j < np (np a multiple of 8). Returns the sum of the kept values,
// added as eight float lanes per 64 values and in double across them.
inline double exp_row(float* s, int64_t i, int64_t np, float scale, float shift) {
  const __m256 vs = _mm256_set1_ps(scale), vsh = _mm256_set1_ps(shift);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256d sum_lo = _mm256_setzero_pd(), sum_hi = _mm256_setzero_pd();
  __m256 acc = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < np; j += 8) {
    __m256 x = _mm256_fmsub_ps(_mm256_loadu_ps(s + j), vs, vsh);
    if (j + 8 > i + 1) {  // keys after i: masked
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(i + 1 - j)), lane);
      x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(keep));
    }
    const __m256 e = cpu::exp8f(x);
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
    if ((j & 63) == 56 || j + 8 >= np) {
      sum_lo = _mm256_add_pd(sum_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(acc)));
      sum_hi = _mm256_add_pd(sum_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1)));
      acc = _mm256_setzero_ps();
    }
  }
  alignas(32) double l[8];
  _mm256_store_pd(l, sum_lo);
  _mm256_store_pd(l + 4, sum_hi);
  double sum = 0;
  for (double v : l) sum += v;
  return sum;
}

// Largest of scale * s_j over j <= i (NaN scores are skipped here and caught by the exponentials).
inline float row_max(const float* s, int64_t i, float scale) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= i + 1; j += 8) m = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s + j), vs), m);
  float mx = cpu::hmax8f(m);
  for (; j <= i; ++j) mx = std::max(scale * s[j], mx);
  return mx;
}

template <class S>
void forward(const Dims& d, const S* pqkv, S* pout, float* plse) {
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const int64_t Dp = round16(d.D), Tp = round16(d.T);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H, g = d.kv_head(h);
    float* q = cpu::thread_scratch<float, cpu::kScratchA>(size_t(3 * d.T * Dp + Dp * Tp + kQBlock * Tp + kQBlock * Dp));
    float* v = q + d.T * Dp;
    float* k = v + d.T * Dp;
    float* kt = k + d.T * Dp;     // (Dp, Tp)
    float* sc = kt + Dp * Tp;     // scores of a query block (kQBlock, Tp)
    float* ob = sc + kQBlock * Tp;  // its outputs (kQBlock, Dp)
    const S* row0 = pqkv + b * d.T * d.W;
    gather_rows(row0 + d.q_off(h), d.W, d.T, d.D, Dp, q);
    gather_rows(row0 + d.v_off(g), d.W, d.T, d.D, Dp, v);
    gather_rows(row0 + d.k_off(g), d.W, d.T, d.D, Dp, k);
    transpose_rows(k, d.T, Dp, Tp, kt);
    for (int64_t i0 = 0; i0 < d.T; i0 += kQBlock) {
      const int64_t m = std::min(kQBlock, d.T - i0), n = i0 + m, np = round16(n);
      gemm16(m, np, Dp, q + i0 * Dp, Dp, 1, kt, Tp, sc, Tp, false);
      for (int64_t r = 0; r < m; ++r) {
        float* s = sc + r * Tp;
        const float mx = row_max(s, i0 + r, scale);
        const double sum = exp_row(s, i0 + r, np, scale, mx);
        plse[bh * d.T + i0 + r] = float(double(mx) + std::log(sum));
        const __m256 inv = _mm256_set1_ps(float(1.0 / sum));
        for (int64_t j = 0; j < np; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
      }
      gemm16(m, Dp, n, sc, Tp, 1, v, Dp, ob, Dp, false);
      for (int64_t r = 0; r < m; ++r) cpu::store_row(ob + r * Dp, pout + (b * d.T + i0 + r) * d.C + h * d.D, d.D);
    }
  }
}

// One task per (batch, key/value head), as flash_backward_impl: each query
// head of the group writes its dq; their dk and dv are summed (each head's in
// float, across heads in double).
template <class S>
void backward(const Dims& d, S* pd, const S* pdo, const S* pqkv, const S* pout, const float* plse) {
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const int64_t G = d.group(), T = d.T, Dp = round16(d.D), Tp = round16(d.T), TDp = T * Dp;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < d.B * d.KV; ++bg) {
    const int64_t b = bg / d.KV, g = bg % d.KV;
    float* k = cpu::thread_scratch<float, cpu::kScratchA>(size_t(7 * TDp + 2 * Dp * Tp + 2 * kQBlock * Tp + T));
    float* v = k + TDp;
    float* qh = v + TDp;
    float* dO = qh + TDp;
    float* dq = dO + TDp;
    float* dk = dq + TDp;
    float* dv = dk + TDp;
    float* kt = dv + TDp;        // (Dp, Tp)
    float* vt = kt + Dp * Tp;
    float* sp = vt + Dp * Tp;    // P, then dS, of a query block (kQBlock, Tp)
    float* dp = sp + kQBlock * Tp;
    float* delta = dp + kQBlock * Tp;
    const S* row0 = pqkv + b * T * d.W;
    gather_rows(row0 + d.k_off(g), d.W, T, d.D, Dp, k);
    gather_rows(row0 + d.v_off(g), d.W, T, d.D, Dp, v);
    transpose_rows(k, T, Dp, Tp, kt);
    transpose_rows(v, T, Dp, Tp, vt);
    double* acc = G > 1 ? cpu::thread_scratch<double, cpu::kScratchB>(size_t(2 * TDp)) : nullptr;
    if (acc) std::fill(acc, acc + 2 * TDp, 0.0);
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const int64_t bh = b * d.H + h;
      gather_rows(row0 + d.q_off(h), d.W, T, d.D, Dp, qh);
      gather_rows(pdo + b * T * d.C + h * d.D, d.C, T, d.D, Dp, dO);
      for (int64_t t = 0; t < T; ++t) {  // delta_t = dO_t . O_t, a row sum: double
        const S* do_row = pdo + (b * T + t) * d.C + h * d.D;
        const S* o_row = pout + (b * T + t) * d.C + h * d.D;
        double s[4] = {0, 0, 0, 0};  // four running sums (a fixed order), then added
        int64_t c = 0;
        for (; c + 4 <= d.D; c += 4)
          for (int l = 0; l < 4; ++l) s[l] += double(load(do_row[c + l])) * double(load(o_row[c + l]));
        for (; c < d.D; ++c) s[0] += double(load(do_row[c])) * double(load(o_row[c]));
        delta[t] = float((s[0] + s[1]) + (s[2] + s[3]));
      }
      std::fill(dq, dq + 3 * TDp, 0.f);
      for (int64_t i0 = 0; i0 < T; i0 += kQBlock) {
        const int64_t m = std::min(kQBlock, T - i0), n = i0 + m, np = round16(n);
        gemm16(m, np, Dp, qh + i0 * Dp, Dp, 1, kt, Tp, sp, Tp, false);  // S = Q K^T
        gemm16(m, np, Dp, dO + i0 * Dp, Dp, 1, vt, Tp, dp, Tp, false);  // dP = dO V^T
        for (int64_t r = 0; r < m; ++r)  // P = e^(scale S - lse), 0 after the diagonal
          exp_row(sp + r * Tp, i0 + r, np, scale, plse[bh * T + i0 + r]);
        gemm16(n, Dp, m, sp, 1, Tp, dO + i0 * Dp, Dp, dv, Dp, true);  // dV += P^T dO
        for (int64_t r = 0; r < m; ++r) {  // dS = P (dP - delta) scale, over P
          float* p = sp + r * Tp;
          const float* dpr = dp + r * Tp;
          const __m256 dl = _mm256_set1_ps(delta[i0 + r]), vs = _mm256_set1_ps(scale);
          for (int64_t j = 0; j < np; j += 8) {
            const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_sub_ps(_mm256_loadu_ps(dpr + j), dl));
            _mm256_storeu_ps(p + j, _mm256_mul_ps(x, vs));
          }
        }
        gemm16(n, Dp, m, sp, 1, Tp, qh + i0 * Dp, Dp, dk, Dp, true);    // dK += dS^T Q
        gemm16(m, Dp, n, sp, Tp, 1, k, Dp, dq + i0 * Dp, Dp, true);     // dQ += dS K
      }
      for (int64_t t = 0; t < T; ++t) cpu::store_row(dq + t * Dp, pd + (b * T + t) * d.W + d.q_off(h), d.D);
      if (acc)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < d.D; ++c) {
            acc[t * Dp + c] += double(dk[t * Dp + c]);
            acc[TDp + t * Dp + c] += double(dv[t * Dp + c]);
          }
    }
    S* base = pd + b * T * d.W;
    for (int64_t t = 0; t < T; ++t) {
      if (acc) {
        for (int64_t c = 0; c < d.D; ++c) {
          base[t * d.W + d.k_off(g) + c] = cpu::store<S>(acc[t * Dp + c]);
          base[t * d.W + d.v_off(g) + c] = cpu::store<S>(acc[TDp + t * Dp + c]);
        }
      } else {
        cpu::store_row(dk + t * Dp, base + t * d.W + d.k_off(g), d.D);
        cpu::store_row(dv + t * Dp, base + t * d.W + d.v_off(g), d.D);
      }
    }
  }
}

}  // namespace blocked

}  // namespace

void flash_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                             int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  XR_ON_CUDA(ctx, flash_attention_forward(ctx, out, lse, qkv, n_head, n_kv_head));
  const char* op = "flash_attention_forward";
  cpu::require_cpu(ctx, op);
  Dims d = check_dims(op, qkv, n_head, n_kv_head);
  check_shape(op, "out", out, {d.B, d.T, d.C});
  check_shape(op, "lse", lse, {d.B, d.H, d.T});
  check_dtype(op, "out", out, qkv.dtype());
  cpu::check_stat_dtype(op, "lse", lse, qkv.dtype());
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    if constexpr (std::is_same_v<compute_t<S>, float>)
      blocked::forward(d, qkv.data<S>(), out.data<S>(), lse.data<float>());
    else
      flash_forward_impl(d, qkv.data<S>(), out.data<S>(), lse.data<compute_t<S>>());
  });
}

void flash_attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  XR_ON_CUDA(ctx, flash_attention_backward(ctx, dqkv, dout, qkv, out, lse, n_head, n_kv_head));
  const char* op = "flash_attention_backward";
  cpu::require_cpu(ctx, op);
  Dims d = check_dims(op, qkv, n_head, n_kv_head);
  check_same_shape(op, dqkv, qkv);
  check_shape(op, "dout", dout, {d.B, d.T, d.C});
  check_shape(op, "out", out, {d.B, d.T, d.C});
  check_shape(op, "lse", lse, {d.B, d.H, d.T});
  check_dtype(op, "dqkv", dqkv, qkv.dtype());
  check_dtype(op, "dout", dout, qkv.dtype());
  check_dtype(op, "out", out, qkv.dtype());
  cpu::check_stat_dtype(op, "lse", lse, qkv.dtype());
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    if constexpr (std::is_same_v<compute_t<S>, float>)
      blocked::backward(d, dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), out.data<S>(), lse.data<float>());
    else
      flash_backward_impl(d, dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), out.data<S>(), lse.data<compute_t<S>>());
  });
}

}  // namespace xirang
