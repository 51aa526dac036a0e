// CPU softmax cross entropy fused with its gradient, and its three-phase
// vocabulary-parallel form (max, sums, finish) for a shard of the columns.
// 16-bit logits are widened to float; losses and row statistics are then F32
// and each gradient element is rounded once, the target's included.
#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/vexp.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::store;

namespace {

// dlogits row (n columns, may alias the logits row) = (softmax - onehot(t)) * dloss,
// t < 0 when the row's target is elsewhere. F32 and F64 subtract dloss from the
// stored target entry (as they always have); 16-bit forms the target's
// value in double so that it too is rounded only once.
// Blocks of a row whose exponentials are taken together (cpu::exp_in_place),
// from a buffer on the stack.
constexpr int64_t kExpBlock = 256;

template <class S>
void softmax_gradient_row(const S* row, S* drow, int64_t n, int64_t t, double logz, double dloss) {
  double e[kExpBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kExpBlock) {
    const int64_t m = std::min(kExpBlock, n - j0);
    for (int64_t j = 0; j < m; ++j) e[j] = double(load(row[j0 + j])) - logz;
    cpu::exp_in_place(e, m);
    for (int64_t j = 0; j < m; ++j) {
      double g = e[j] * dloss;
      if constexpr (is_16bit_v<S>)
        if (j0 + j == t) g -= dloss;
      drow[j0 + j] = store<S>(g);
    }
  }
  if constexpr (!is_16bit_v<S>)
    if (t >= 0) drow[t] -= S(dloss);
}

// sum over j < n of e^(x_j - mx), added in order in double; `shift` is
// applied in T (x_j - mx rounded to T, as the unsharded loss does) or in
// double (the shards').
template <class S, class T, bool kShiftInT>
double sum_exp_row(const S* row, int64_t n, T mx) {
  double e[kExpBlock];
  double sum = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kExpBlock) {
    const int64_t m = std::min(kExpBlock, n - j0);
    for (int64_t j = 0; j < m; ++j)
      e[j] = kShiftInT ? double(load(row[j0 + j]) - mx) : double(load(row[j0 + j])) - double(mx);
    cpu::exp_in_place(e, m);
    for (int64_t j = 0; j < m; ++j) sum += e[j];
  }
  return sum;
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
      T mx = load(row[0]);
      for (int64_t j = 1; j < vocab_size; ++j) mx = std::max(mx, load(row[j]));
      const double sum = sum_exp_row<S, T, true>(row, vocab_size, mx);
      double logz = std::log(sum) + double(mx);
      T target_logit = load(row[tg[i]]);
      pls[i] = T(logz - double(target_logit));
      if (pd) {
        S* drow = pd + i * Vp;  // may alias row: each element is read before it is written
        softmax_gradient_row(row, drow, vocab_size, tg[i], logz, dloss);
        std::fill(drow + vocab_size, drow + Vp, S{});
      }
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
      for (int64_t j = 0; j < n_real; ++j) mx = std::max(mx, load(row[j]));
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
      const double sum = sum_exp_row<S, T, false>(row, n_real, pm[i]);
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
      softmax_gradient_row(row, drow, n_real, (t >= 0 && t < n_real) ? t : -1, logz, dloss);
      std::fill(drow + n_real, drow + Vs, S{});
    }
  });
}

}  // namespace xirang
