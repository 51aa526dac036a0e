// CPU softmax cross entropy fused with its gradient, and its three-phase
// vocabulary-parallel form (max, sums, finish) for a shard of the columns.
// 16-bit logits are widened to float; losses and row statistics are then F32
// and each gradient element is rounded once, the target's included.
//
// F32, BF16 and F16 rows are read from memory once: a per-lane running max
// and sum of exponentials (cpu::exp8f, sums in double), then the gradient
// from the row still in cache, written over the logits when dlogits aliases
// them (as the model calls it). One row per loop iteration, so each row's
// result is the same whatever the thread count. F64 keeps its double path.
//
//   cross_entropy_forward_backward(ctx, losses, logits, logits, targets, vocab_size, 1.0 / N);
#include "kernels/cross_entropy.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/vexp.h"
#include "kernels/cpu/vexpf.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::store;

namespace {

// ---------------------------------------------------------------- F64

// dlogits row (n columns, may alias the logits row) = (softmax - onehot(t)) * dloss,
// t < 0 when the row's target is elsewhere; F64 subtracts dloss from the
// stored target entry. Blocks of a row whose exponentials are taken
// together (cpu::exp_in_place), from a buffer on the stack.
constexpr int64_t kExpBlock = 256;

void softmax_gradient_row(const double* row, double* drow, int64_t n, int64_t t, double logz, double dloss) {
  double e[kExpBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kExpBlock) {
    const int64_t m = std::min(kExpBlock, n - j0);
    for (int64_t j = 0; j < m; ++j) e[j] = row[j0 + j] - logz;
    cpu::exp_in_place(e, m);
    for (int64_t j = 0; j < m; ++j) drow[j0 + j] = e[j] * dloss;
  }
  if (t >= 0) drow[t] -= dloss;
}

// sum over j < n of e^(x_j - mx), added in order in double.
double sum_exp_row(const double* row, int64_t n, double mx) {
  double e[kExpBlock];
  double sum = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kExpBlock) {
    const int64_t m = std::min(kExpBlock, n - j0);
    for (int64_t j = 0; j < m; ++j) e[j] = row[j0 + j] - mx;
    cpu::exp_in_place(e, m);
    for (int64_t j = 0; j < m; ++j) sum += e[j];
  }
  return sum;
}

// ---------------------------------------------------------------- F32, BF16, F16
//
// The float paths read a row in blocks of kBlock floats (eight AVX vectors),
// 16-bit blocks widened into a stack buffer first. Exponentials are
// cpu::exp8f of float arguments <= 0; the row sums are kept in double.

constexpr int64_t kBlock = 64;

// Block j0 of a row of n values as kBlock floats: the row itself (F32, full
// block), else `buf` filled with the widened values and padded with -inf
// (whose exponentials are 0).
template <class S>
const float* float_block(const S* row, int64_t j0, int64_t n, float* buf) {
  const int64_t m = std::min(kBlock, n - j0);
  if constexpr (std::is_same_v<S, float>)
    if (m == kBlock) return row + j0;
  cpu::load_row(row + j0, buf, m);
  std::fill(buf + m, buf + kBlock, -std::numeric_limits<float>::infinity());
  return buf;
}

// A row's softmax statistics: its max and lse = log sum_j e^(x_j - max).
struct RowStats {
  float max;
  double lse;
};

// One read of the row (n >= 1 values): a running max and sum per lane (the
// sum rescaled in double when its lane's max grows), combined at the end.
// The order of operations depends on n alone, not on the thread. A NaN
// logit makes lse NaN (its exponential enters the sum).
template <class S>
RowStats row_stats(const S* row, int64_t n) {
  alignas(32) float buf[kBlock];
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::max());
  __m256d s_lo = _mm256_setzero_pd(), s_hi = _mm256_setzero_pd();
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const float* x = float_block(row, j0, n, buf);
    __m256 v[kBlock / 8];
    __m256 bm = m;
    for (int k = 0; k < kBlock / 8; ++k) {
      v[k] = _mm256_loadu_ps(x + 8 * k);
      bm = _mm256_max_ps(v[k], bm);  // a NaN v lane keeps bm
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(bm, m, _CMP_GT_OQ))) {
      // The lanes whose max grew scale their sums by e^(old - new) (1 elsewhere).
      using cpu::vexp_detail::D4;
      D4 f_lo, f_hi;
      const __m256d d_lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(m)),
                                         _mm256_cvtps_pd(_mm256_castps256_ps128(bm)));
      const __m256d d_hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(m, 1)),
                                         _mm256_cvtps_pd(_mm256_extractf128_ps(bm, 1)));
      std::memcpy(&f_lo, &d_lo, sizeof f_lo);
      std::memcpy(&f_hi, &d_hi, sizeof f_hi);
      f_lo = cpu::vexp_detail::exp4(f_lo);
      f_hi = cpu::vexp_detail::exp4(f_hi);
      __m256d g_lo, g_hi;
      std::memcpy(&g_lo, &f_lo, sizeof g_lo);
      std::memcpy(&g_hi, &f_hi, sizeof g_hi);
      s_lo = _mm256_mul_pd(s_lo, g_lo);
      s_hi = _mm256_mul_pd(s_hi, g_hi);
      m = bm;
    }
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < kBlock / 8; ++k) acc = _mm256_add_ps(acc, cpu::exp8f(_mm256_sub_ps(v[k], m)));
    s_lo = _mm256_add_pd(s_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(acc)));
    s_hi = _mm256_add_pd(s_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1)));
  }
  alignas(32) float ml[8];
  alignas(32) double sl[8];
  _mm256_store_ps(ml, m);
  _mm256_store_pd(sl, s_lo);
  _mm256_store_pd(sl + 4, s_hi);
  const float mx = *std::max_element(ml, ml + 8);
  double sum = 0;
  for (int l = 0; l < 8; ++l) sum += sl[l] * std::exp(double(ml[l]) - double(mx));
  return {mx, std::log(sum)};
}

// sum over j < n of e^(x_j - mx) for a given mx >= every x_j: each block's
// eight-lane float sum is added in double.
template <class S>
double sum_exp_shifted(const S* row, int64_t n, float mx) {
  alignas(32) float buf[kBlock];
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256d s_lo = _mm256_setzero_pd(), s_hi = _mm256_setzero_pd();
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const float* x = float_block(row, j0, n, buf);
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < kBlock / 8; ++k)
      acc = _mm256_add_ps(acc, cpu::exp8f(_mm256_sub_ps(_mm256_loadu_ps(x + 8 * k), vmx)));
    s_lo = _mm256_add_pd(s_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(acc)));
    s_hi = _mm256_add_pd(s_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1)));
  }
  alignas(32) double sl[8];
  _mm256_store_pd(sl, s_lo);
  _mm256_store_pd(sl + 4, s_hi);
  double sum = 0;
  for (double v : sl) sum += v;
  return sum;
}

// dlogits row (n columns, may alias the logits row: each block is read
// before it is written) = (softmax - onehot(t)) * dloss with softmax_j =
// e^((x_j - max) - lse) in float, t < 0 when the row's target is elsewhere.
// F32 subtracts dloss from the stored target entry; 16-bit subtracts it in
// float and rounds each entry once.
template <class S>
void softmax_gradient_row(const S* row, S* drow, int64_t n, int64_t t, float mx, float lse, float dloss) {
  alignas(32) float buf[kBlock];
  const __m256 vmx = _mm256_set1_ps(mx), vlse = _mm256_set1_ps(lse), vdl = _mm256_set1_ps(dloss);
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t m = std::min(kBlock, n - j0);
    const float* x = float_block(row, j0, n, buf);
    float* g = (std::is_same_v<S, float> && m == kBlock) ? reinterpret_cast<float*>(drow + j0) : buf;
    for (int k = 0; k < kBlock / 8; ++k) {
      const __m256 e = cpu::exp8f(_mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + 8 * k), vmx), vlse));
      _mm256_storeu_ps(g + 8 * k, _mm256_mul_ps(e, vdl));
    }
    if constexpr (is_16bit_v<S>) {
      if (t >= j0 && t < j0 + m) buf[t - j0] -= dloss;
      cpu::store_row(buf, drow + j0, m);
    } else if (g == buf) {
      std::copy(buf, buf + m, drow + j0);
    }
  }
  if constexpr (!is_16bit_v<S>)
    if (t >= 0) drow[t] -= dloss;
}

}  // namespace

void cross_entropy_forward_backward(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                    const Tensor& targets, int64_t vocab_size, double dloss) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Loss);
  XR_ON_CUDA(ctx, cross_entropy_forward_backward(ctx, losses, dlogits, logits, targets, vocab_size, dloss));
  cpu::require_cpu(ctx, "cross_entropy");
  Tensor l2 = logits.flat2d();
  int64_t N = l2.size(0), Vp = l2.size(1);
  if (vocab_size <= 0 || vocab_size > Vp)
    fail(ErrorKind::Shape, "cross_entropy: vocab_size ", vocab_size, " outside (0, ", Vp, "]");
  check_shape("cross_entropy", "targets", targets.flat(), {N});
  check_shape("cross_entropy", "losses", losses.flat(), {N});
  check_dtype("cross_entropy", "targets", targets, DType::I32);
  cpu::check_stat_dtype("cross_entropy", "losses", losses, logits.dtype());
  if (dlogits.defined()) {
    check_same_shape("cross_entropy", dlogits, logits);
    check_dtype("cross_entropy", "dlogits", dlogits, logits.dtype());
  }
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t i = 0; i < N; ++i)
    if (tg[i] < 0 || tg[i] >= vocab_size)
      fail(ErrorKind::Data, "cross_entropy: target ", tg[i], " at position ", i, " is outside [0, ", vocab_size, ")");
  dispatch_storage(logits.dtype(), "cross_entropy", [&](auto tag) {
    using S = decltype(tag);
    using T = compute_t<S>;
    const S* pl = logits.data<S>();
    T* pls = losses.data<T>();
    S* pd = dlogits.defined() ? dlogits.data<S>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const S* row = pl + i * Vp;
      S* drow = pd ? pd + i * Vp : nullptr;  // may alias row
      const T target_logit = load(row[tg[i]]);
      if constexpr (std::is_same_v<S, double>) {
        double mx = row[0];
        for (int64_t j = 1; j < vocab_size; ++j) mx = std::max(mx, row[j]);
        const double logz = std::log(sum_exp_row(row, vocab_size, mx)) + mx;
        pls[i] = logz - target_logit;
        if (drow) softmax_gradient_row(row, drow, vocab_size, tg[i], logz, dloss);
      } else {
        const RowStats st = row_stats(row, vocab_size);
        pls[i] = T(double(st.max) + st.lse - double(target_logit));
        if (drow) softmax_gradient_row(row, drow, vocab_size, tg[i], st.max, float(st.lse), float(dloss));
      }
      if (drow) std::fill(drow + vocab_size, drow + Vp, S{});
    }
  });
}


namespace {

// Columns of a shard that are real vocabulary entries: [0, n) with n =
// clamp(vocab_size - vocab_begin, 0, V_shard). The rest (possibly all of
// them, for a shard lying wholly in the padding) take no part.
int64_t real_columns(int64_t vocab_begin, int64_t vocab_size, int64_t shard_width) {
  return std::clamp<int64_t>(vocab_size - vocab_begin, 0, shard_width);
}

// Checks shared by the three phases; returns the logits as (N, V_shard).
Tensor check_shard(const char* op, const Tensor& logits, int64_t vocab_begin, int64_t vocab_size) {
  if (logits.rank() < 1) fail(ErrorKind::Shape, op, ": logits must be (N, V_shard), got ", logits.shape().str());
  if (vocab_size <= 0 || vocab_begin < 0)
    fail(ErrorKind::Shape, op, ": vocab_begin ", vocab_begin, " and vocab_size ", vocab_size,
         " must satisfy vocab_begin >= 0 and vocab_size > 0");
  return logits.flat2d();
}

// A per-row statistic or loss beside logits of dtype s: F32 when s is 16-bit.
void check_row_vector(const char* op, const char* what, const Tensor& t, int64_t N, DType s) {
  check_shape(op, what, t.flat(), {N});
  cpu::check_stat_dtype(op, what, t, s);
}

void check_targets(const char* op, const Tensor& targets, int64_t N, int64_t vocab_size) {
  check_shape(op, "targets", targets.flat(), {N});
  check_dtype(op, "targets", targets, DType::I32);
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t i = 0; i < N; ++i)
    if (tg[i] < 0 || tg[i] >= vocab_size)
      fail(ErrorKind::Data, op, ": target ", tg[i], " at position ", i, " is outside [0, ", vocab_size, ")");
}

}  // namespace

void cross_entropy_shard_max(const KernelContext& ctx, Tensor row_max, const Tensor& logits, int64_t vocab_begin,
                             int64_t vocab_size) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Loss);
  XR_ON_CUDA(ctx, cross_entropy_shard_max(ctx, row_max, logits, vocab_begin, vocab_size));
  const char* op = "cross_entropy_shard_max";
  cpu::require_cpu(ctx, op);
  Tensor l2 = check_shard(op, logits, vocab_begin, vocab_size);
  const int64_t N = l2.size(0), Vs = l2.size(1), n_real = real_columns(vocab_begin, vocab_size, Vs);
  check_row_vector(op, "row_max", row_max, N, logits.dtype());
  dispatch_storage(logits.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using T = compute_t<S>;
    const S* pl = l2.data<S>();
    T* pm = row_max.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const S* row = pl + i * Vs;
      // -inf is the identity of the Max all-reduce, so a shard without real
      // columns leaves the global max to the others.
      T mx = -std::numeric_limits<T>::infinity();
      if constexpr (std::is_same_v<S, float>) {  // eight lanes (a NaN logit is skipped, as below)
        __m256 m = _mm256_set1_ps(mx);
        int64_t j = 0;
        for (; j + 8 <= n_real; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(row + j), m);
        mx = cpu::hmax8f(m);
        for (; j < n_real; ++j) mx = std::max(mx, row[j]);
      } else {
        for (int64_t j = 0; j < n_real; ++j) mx = std::max(mx, load(row[j]));
      }
      pm[i] = mx;
    }
  });
}

void cross_entropy_shard_sums(const KernelContext& ctx, Tensor sums, const Tensor& logits, const Tensor& targets,
                              const Tensor& row_max, int64_t vocab_begin, int64_t vocab_size) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Loss);
  XR_ON_CUDA(ctx, cross_entropy_shard_sums(ctx, sums, logits, targets, row_max, vocab_begin, vocab_size));
  const char* op = "cross_entropy_shard_sums";
  cpu::require_cpu(ctx, op);
  Tensor l2 = check_shard(op, logits, vocab_begin, vocab_size);
  const int64_t N = l2.size(0), Vs = l2.size(1), n_real = real_columns(vocab_begin, vocab_size, Vs);
  check_row_vector(op, "row_max", row_max, N, logits.dtype());
  check_shape(op, "sums", sums, {N, 2});
  cpu::check_stat_dtype(op, "sums", sums, logits.dtype());
  check_targets(op, targets, N, vocab_size);
  dispatch_storage(logits.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using T = compute_t<S>;
    const S* pl = l2.data<S>();
    const T* pm = row_max.data<T>();
    const int32_t* tg = targets.data<int32_t>();
    T* ps = sums.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const S* row = pl + i * Vs;
      // Summed in double: a shard's partial sum is rounded to T once, when stored.
      double sum;
      if constexpr (std::is_same_v<S, double>) sum = sum_exp_row(row, n_real, pm[i]);
      else sum = sum_exp_shifted(row, n_real, pm[i]);
      const int64_t t = int64_t(tg[i]) - vocab_begin;
      // The target logit travels in the Sum all-reduce: exactly one shard
      // holds the target, every other one contributes 0.
      ps[2 * i] = T(sum);
      ps[2 * i + 1] = (t >= 0 && t < n_real) ? load(row[t]) : T(0);
    }
  });
}

void cross_entropy_shard_finish(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                const Tensor& targets, const Tensor& row_max, const Tensor& sums,
                                int64_t vocab_begin, int64_t vocab_size, double dloss) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Loss);
  XR_ON_CUDA(ctx, cross_entropy_shard_finish(ctx, losses, dlogits, logits, targets, row_max, sums, vocab_begin, vocab_size, dloss));
  const char* op = "cross_entropy_shard_finish";
  cpu::require_cpu(ctx, op);
  Tensor l2 = check_shard(op, logits, vocab_begin, vocab_size);
  const int64_t N = l2.size(0), Vs = l2.size(1), n_real = real_columns(vocab_begin, vocab_size, Vs);
  check_row_vector(op, "row_max", row_max, N, logits.dtype());
  check_row_vector(op, "losses", losses, N, logits.dtype());
  check_shape(op, "sums", sums, {N, 2});
  cpu::check_stat_dtype(op, "sums", sums, logits.dtype());
  check_targets(op, targets, N, vocab_size);
  if (dlogits.defined()) {
    check_same_shape(op, dlogits, logits);
    check_dtype(op, "dlogits", dlogits, logits.dtype());
  }
  dispatch_storage(logits.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using T = compute_t<S>;
    const S* pl = l2.data<S>();
    const T* pm = row_max.data<T>();
    const T* ps = sums.data<T>();
    const int32_t* tg = targets.data<int32_t>();
    T* pls = losses.data<T>();
    S* pd = dlogits.defined() ? dlogits.data<S>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const double logz = std::log(double(ps[2 * i])) + double(pm[i]);
      pls[i] = T(logz - double(ps[2 * i + 1]));
      if (!pd) continue;
      const S* row = pl + i * Vs;
      S* drow = pd + i * Vs;  // may alias row: each element is read before it is written
      const int64_t t = int64_t(tg[i]) - vocab_begin;
      const int64_t tl = (t >= 0 && t < n_real) ? t : -1;
      if constexpr (std::is_same_v<S, double>)
        softmax_gradient_row(row, drow, n_real, tl, logz, dloss);
      else
        softmax_gradient_row(row, drow, n_real, tl, pm[i], float(std::log(double(ps[2 * i]))), float(dloss));
      std::fill(drow + n_real, drow + Vs, S{});
    }
  });
}

}  // namespace xirang
