// CPU context-parallel attention: one rank's query rows against the keys and
// values of the whole sequence (kernels/cp_attention.h).
//
// A task first gathers its key/value head's k and v rows from kv_all into
// global position order (positions 0 .. the rank's last position; the later
// ones are never attended to), so that the row loops are those of the flash
// pair in attention.cc with query row t at position p = split.position(rank,
// t) in place of t. One task per (batch, head) forward and per (batch,
// key/value head) backward; each writes a disjoint slice of the outputs, so
// results do not depend on the thread count. With float compute (F32, BF16,
// F16 storage) the pair runs the blocked path instead
// (kernels/cpu/cp_attention_blocked.cc: query blocks as AVX2/FMA matrix
// products, several times faster); F64 keeps these row loops as the reference.
//
//   cp_attention_forward(ctx, out, lse, qkv, kv_all, split, rank, H, KV);
#include "kernels/cp_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cp_attention_checks.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/cp_attention_blocked.h"
#include "kernels/cpu/common.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::attention_rows::axpy;
using cpu::attention_rows::dot;
using cpu::attention_rows::narrow;
using cpu::attention_rows::widen;
using cp_attention_checks::CpDims;

namespace {

// One rank's view of the gathered sequence.
struct Layout {
  CpDims cd;
  ContextSplit split;
  int rank;
  int64_t P;  // positions a local query can reach: the rank's last position + 1

  // kv_all's row holding position p of batch b.
  int64_t kv_row(int64_t b, int64_t p) const {
    int owner;
    const int64_t r = split.local_row(p, &owner);
    return (int64_t(owner) * cd.d.B + b) * cd.d.T + r;
  }
};

// Key/value head g's k and v at positions [0, P) of batch b, widened into
// contiguous rows of D.
template <class S>
void gather_kv(const Layout& l, const S* pkv, int64_t b, int64_t g, compute_t<S>* k, compute_t<S>* v) {
  const auto& d = l.cd.d;
  for (int64_t p = 0; p < l.P; ++p) {
    const S* row = pkv + l.kv_row(b, p) * l.cd.kvw;
    widen(row + g * d.D, k + p * d.D, d.D);
    widen(row + (d.KV + g) * d.D, v + p * d.D, d.D);
  }
}

template <class S>
void forward_impl(const Layout& l, const S* pqkv, const S* pkv, S* pout, compute_t<S>* plse) {
  using T = compute_t<S>;
  const auto& d = l.cd.d;
  const T scale = T(1.0 / std::sqrt(double(d.D)));
  const int64_t PD = l.P * d.D;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    T* k = cpu::thread_scratch<T, cpu::kScratchA>(size_t(2 * PD + l.P + 2 * d.D));
    T* v = k + PD;
    T* s = v + PD;    // one row's scores (P)
    T* q = s + l.P;   // one query row (D), then an output row (D)
    T* o_scratch = q + d.D;
    gather_kv(l, pkv, b, d.kv_head(h), k, v);
    for (int64_t t = 0; t < d.T; ++t) {
      const int64_t p = l.split.position(l.rank, t);
      widen(pqkv + (b * d.T + t) * d.W + d.q_off(h), q, d.D);
      // As attention.cc's exp_scores and flash_forward_impl, key range [0, p].
      T mx = -INFINITY;
      for (int64_t j = 0; j <= p; ++j) {
        s[j] = scale * dot(q, k + j * d.D, d.D);
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j <= p; ++j) {
        s[j] = std::exp(s[j] - mx);
        sum += s[j];
      }
      plse[bh * d.T + t] = T(double(mx) + std::log(sum));
      const T inv = T(1.0 / sum);
      S* orow = pout + (b * d.T + t) * d.C + h * d.D;
      T* o;
      if constexpr (is_16bit_v<S>) o = o_scratch;
      else o = orow;
      std::fill(o, o + d.D, T(0));
      for (int64_t j = 0; j <= p; ++j) axpy(s[j] * inv, v + j * d.D, o, d.D);
      if constexpr (is_16bit_v<S>) cpu::store_row(o, orow, d.D);
    }
  }
}

// One task per (batch, key/value head), as attention.cc's
// flash_backward_impl: each query head's dq is written as it finishes, the
// heads' dk and dv (per head in the compute type) are summed over the group
// in double, then written to every rank's block of dkv_all (zero past P).
template <class S>
void backward_impl(const Layout& l, S* pdq, S* pdkv, const S* pdo, const S* pqkv, const S* pkv, const S* pout,
                   const compute_t<S>* plse) {
  using T = compute_t<S>;
  const auto& d = l.cd.d;
  const T scale = T(1.0 / std::sqrt(double(d.D)));
  const int64_t G = d.group(), PD = l.P * d.D, TD = d.T * d.D;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < d.B * d.KV; ++bg) {
    const int64_t b = bg / d.KV, g = bg % d.KV;
    T* k = cpu::thread_scratch<T, cpu::kScratchA>(size_t(4 * PD + 2 * TD + d.D));
    T* v = k + PD;
    T* dk = v + PD;   // the current query head's, by position
    T* dv = dk + PD;
    T* qh = dv + PD;  // the current query head's q and dq, by local row
    T* dq = qh + TD;
    T* do_scratch = dq + TD;
    gather_kv(l, pkv, b, g, k, v);
    double* acc = G > 1 ? cpu::thread_scratch<double, cpu::kScratchB>(size_t(2 * PD)) : nullptr;
    if (acc) std::fill(acc, acc + 2 * PD, 0.0);
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const int64_t bh = b * d.H + h;
      for (int64_t t = 0; t < d.T; ++t) widen(pqkv + (b * d.T + t) * d.W + d.q_off(h), qh + t * d.D, d.D);
      std::fill(dk, dk + 2 * PD, T(0));
      std::fill(dq, dq + TD, T(0));
      for (int64_t t = 0; t < d.T; ++t) {
        const int64_t p = l.split.position(l.rank, t);
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
        for (int64_t j = 0; j <= p; ++j) {
          const T pr = std::exp(scale * dot(q, k + j * d.D, d.D) - lse);
          const T dp = dot(dot_, v + j * d.D, d.D);
          axpy(pr, dot_, dv + j * d.D, d.D);
          const T ds = T(pr * (dp - delta) * scale);
          axpy(ds, k + j * d.D, dqt, d.D);
          axpy(ds, q, dk + j * d.D, d.D);
        }
      }
      for (int64_t t = 0; t < d.T; ++t) narrow<S>(dq + t * d.D, pdq + (b * d.T + t) * d.W + d.q_off(h), d.D);
      if (acc)
        for (int64_t i = 0; i < PD; ++i) {
          acc[i] += double(dk[i]);
          acc[PD + i] += double(dv[i]);
        }
    }
    // Every rank's rows of this (batch, key/value head), in kv_all's layout.
    for (int64_t r = 0; r < l.cd.c; ++r)
      for (int64_t t = 0; t < d.T; ++t) {
        const int64_t p = l.split.position(int(r), t);
        S* row = pdkv + ((r * d.B + b) * d.T + t) * l.cd.kvw;
        S* dkr = row + g * d.D;
        S* dvr = row + (d.KV + g) * d.D;
        if (p >= l.P) {
          std::fill(dkr, dkr + d.D, S{});
          std::fill(dvr, dvr + d.D, S{});
        } else if (acc) {
          for (int64_t c = 0; c < d.D; ++c) {
            dkr[c] = cpu::store<S>(acc[p * d.D + c]);
            dvr[c] = cpu::store<S>(acc[PD + p * d.D + c]);
          }
        } else {
          narrow<S>(dk + p * d.D, dkr, d.D);
          narrow<S>(dv + p * d.D, dvr, d.D);
        }
      }
  }
}

Layout layout_of(const CpDims& cd, const ContextSplit& split, int rank) {
  return {cd, split, rank, split.position(rank, cd.d.T - 1) + 1};
}

// Copies `width` elements per row between two row-major tensors of the same dtype.
void copy_columns(const Tensor& dst, int64_t dst_ld, int64_t dst_off, const Tensor& src, int64_t src_ld,
                  int64_t src_off, int64_t rows, int64_t width) {
  const size_t es = dtype_size(src.dtype());
  const char* ps = static_cast<const char*>(src.raw());
  char* pd = static_cast<char*>(dst.raw());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(pd + (r * dst_ld + dst_off) * es, ps + (r * src_ld + src_off) * es, size_t(width) * es);
}

}  // namespace

void cp_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, const Tensor& kv_all,
                          const ContextSplit& split, int rank, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  XR_ON_CUDA(ctx, cp_attention_forward(ctx, out, lse, qkv, kv_all, split, rank, n_head, n_kv_head));
  const char* op = "cp_attention_forward";
  cpu::require_cpu(ctx, op);
  const CpDims cd = cp_attention_checks::check_dims(op, qkv, kv_all, split, rank, n_head, n_kv_head);
  const auto& d = cd.d;
  check_shape(op, "out", out, {d.B, d.T, d.C});
  check_shape(op, "lse", lse, {d.B, d.H, d.T});
  check_dtype(op, "out", out, qkv.dtype());
  cpu::check_stat_dtype(op, "lse", lse, qkv.dtype());
  if (d.B == 0) return;
  const Layout l = layout_of(cd, split, rank);
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    if constexpr (std::is_same_v<compute_t<S>, float>)
      cpu::cp_attention_blocked::forward(cd, split, rank, qkv.data<S>(), kv_all.data<S>(), out.data<S>(),
                                         lse.data<float>());
    else
      forward_impl(l, qkv.data<S>(), kv_all.data<S>(), out.data<S>(), lse.data<compute_t<S>>());
  });
}

void cp_attention_backward(const KernelContext& ctx, Tensor dqkv, Tensor dkv_all, const Tensor& dout,
                           const Tensor& qkv, const Tensor& kv_all, const Tensor& out, const Tensor& lse,
                           const ContextSplit& split, int rank, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  XR_ON_CUDA(ctx, cp_attention_backward(ctx, dqkv, dkv_all, dout, qkv, kv_all, out, lse, split, rank, n_head,
                                        n_kv_head));
  const char* op = "cp_attention_backward";
  cpu::require_cpu(ctx, op);
  const CpDims cd = cp_attention_checks::check_dims(op, qkv, kv_all, split, rank, n_head, n_kv_head);
  attention_checks::check_backward_operands(op, cd.d, dqkv, dout, qkv, out, lse);
  check_shape(op, "dkv_all", dkv_all, kv_all.shape());
  check_dtype(op, "dkv_all", dkv_all, qkv.dtype());
  cpu::check_stat_dtype(op, "lse", lse, qkv.dtype());
  if (cd.d.B == 0) return;
  const Layout l = layout_of(cd, split, rank);
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    if constexpr (std::is_same_v<compute_t<S>, float>)
      cpu::cp_attention_blocked::backward(cd, split, rank, dqkv.data<S>(), dkv_all.data<S>(), dout.data<S>(),
                                          qkv.data<S>(), kv_all.data<S>(), out.data<S>(), lse.data<float>());
    else
      backward_impl(l, dqkv.data<S>(), dkv_all.data<S>(), dout.data<S>(), qkv.data<S>(), kv_all.data<S>(),
                  out.data<S>(), lse.data<compute_t<S>>());
  });
}

CpAttentionWork cp_attention_work(const ContextSplit& split, int rank) {
  cp_attention_checks::check_split("cp_attention_work", split, rank);
  CpAttentionWork w;
  for (int64_t t = 0; t < split.local_rows(); ++t) w.causal_pairs += split.position(rank, t) + 1;
  w.computed_pairs = cpu::cp_attention_blocked::computed_pairs(split, rank);
  return w;
}

void kv_pack(const KernelContext& ctx, Tensor kv, const Tensor& qkv, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, kv_pack(ctx, kv, qkv, n_head, n_kv_head));
  const char* op = "kv_pack";
  cpu::require_cpu(ctx, op);
  const auto d = cp_attention_checks::check_kv(op, qkv, kv, n_head, n_kv_head);
  const int64_t kvw = 2 * d.KV * d.D;
  copy_columns(kv, kvw, 0, qkv, d.W, d.C, d.B * d.T, kvw);
}

void kv_unpack(const KernelContext& ctx, Tensor dqkv, const Tensor& dkv, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, kv_unpack(ctx, dqkv, dkv, n_head, n_kv_head));
  const char* op = "kv_unpack";
  cpu::require_cpu(ctx, op);
  const auto d = cp_attention_checks::check_kv(op, dqkv, dkv, n_head, n_kv_head);
  const int64_t kvw = 2 * d.KV * d.D;
  copy_columns(dqkv, d.W, d.C, dkv, kvw, 0, d.B * d.T, kvw);
}

}  // namespace xirang
