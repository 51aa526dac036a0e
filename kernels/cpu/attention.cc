// CPU causal self-attention. One task per (batch, head), or for the flash
// backward per (batch, key/value head): each touches a disjoint slice of the
// outputs, so the parallel loop needs no reductions and the results do not
// depend on the thread count. The loops run inside the
// OpenMP region rather than calling BLAS there, so OpenBLAS's own threads
// never nest inside ours.
//
// The flash pair with F32, BF16 or F16 storage runs the blocked path
// (kernels/cpu/attention_blocked.cc: query blocks as AVX2/FMA matrix products); F64
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
#include "kernels/cpu/attention_blocked.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/common.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::store;
using attention_checks::check_dims;
using attention_checks::Dims;

namespace {

using cpu::attention_rows::axpy;
using cpu::attention_rows::dot;
using cpu::attention_rows::narrow;
using cpu::attention_rows::widen;

// Softmax sums of the probability-based pair: F32 and F64 keep summing in
// their own type, as they always have (their results are pinned by golden
// losses); the 16-bit paths sum in double as kernels/context.h asks.
template <class S>
using softmax_sum_t = std::conditional_t<is_16bit_v<S>, double, compute_t<S>>;

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
      cpu::attention_blocked::forward(d, qkv.data<S>(), out.data<S>(), lse.data<float>());
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
  attention_checks::check_backward_operands(op, d, dqkv, dout, qkv, out, lse);
  cpu::check_stat_dtype(op, "lse", lse, qkv.dtype());
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    if constexpr (std::is_same_v<compute_t<S>, float>)
      cpu::attention_blocked::backward(d, dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), out.data<S>(), lse.data<float>());
    else
      flash_backward_impl(d, dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), out.data<S>(), lse.data<compute_t<S>>());
  });
}

AttentionPath flash_attention_path(Device device, DType dtype, int64_t head_dim) {
  if (device == Device::CPU) return AttentionPath::Cpu;
  const bool half = dtype == DType::BF16 || dtype == DType::F16;
  const bool dim = head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
  return half && dim ? AttentionPath::TensorCores : AttentionPath::CudaCores;
}

std::string flash_attention_path_name(Device device, DType dtype, int64_t head_dim) {
  const std::string what = std::string(" (") + dtype_name(dtype) + ", head dim " + std::to_string(head_dim) + ")";
  switch (flash_attention_path(device, dtype, head_dim)) {
    case AttentionPath::TensorCores: return "tensor cores" + what;
    case AttentionPath::CudaCores: return "fp32 CUDA cores" + what;
    case AttentionPath::Cpu: break;
  }
  return "CPU" + what;
}

}  // namespace xirang
