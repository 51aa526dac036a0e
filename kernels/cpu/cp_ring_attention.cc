// CPU ring attention steps (kernels/cp_ring_attention.h).
//
// Each step is kernels/cpu/cp_attention_blocked.cc's float path with the
// keys of one block: a task per (batch, head) forward and per (batch,
// key/value head) backward gathers the block's rows (already in position
// order) instead of every rank's, and a query block's mask is the prefix
// cp_ring_keys_seen gives each row. Forward normalizes the block's partial
// output and merges it into the accumulators row by row; backward uses the
// final lse, so no merge is needed there. Each task writes a disjoint slice
// of every output: results do not depend on the thread count.
#include "kernels/cp_ring_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cp_attention_checks.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/cp_attention_blocked.h"

namespace xirang {

using cpu::load;
using namespace cpu::attention_tiles;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys per piece of a long row, as cp_attention_blocked.cc (there: why).
constexpr int64_t kKeyPiece = 512;
constexpr int64_t kPieceLd = kKeyPiece + 16;

// One row of the merge, in double: (o, lse) <- (o, lse) (+) (op, lp).
inline void merge_row(float* o, float* lse, const float* op, float lp, int64_t D) {
  if (lp == kNegInf) return;  // the block gave this row no key
  if (*lse == kNegInf) {
    std::copy(op, op + D, o);
    *lse = lp;
    return;
  }
  const double a = *lse, b = lp, m = std::max(a, b);
  const double l = m + std::log(std::exp(a - m) + std::exp(b - m));
  const double wa = std::exp(a - l), wb = std::exp(b - l);
  for (int64_t c = 0; c < D; ++c) o[c] = float(wa * double(o[c]) + wb * double(op[c]));
  *lse = float(l);
}

// The step's shapes: the local qkv, the block kv beside it, the padded widths.
struct Step {
  attention_checks::Dims d;
  const ContextSplit& split;
  int rank, src;
  int64_t kvw, Dp, Kp;  // Kp: the block's 2L keys rounded up to an odd multiple of 16 (cache sets)
  int64_t seen(int64_t p) const { return cp_ring_keys_seen(split, src, p); }
};

Step check_step(const char* op, const Tensor& qkv, const Tensor& kv, const ContextSplit& split, int rank, int src,
                int n_head, int n_kv_head) {
  cp_attention_checks::check_split(op, split, rank);
  cp_attention_checks::check_split(op, split, src);
  const attention_checks::Dims d = cp_attention_checks::check_kv(op, qkv, kv, n_head, n_kv_head);
  if (d.T != split.local_rows())
    fail(ErrorKind::Shape, op, ": qkv has ", d.T, " rows per sequence, the split gives each rank ", split.local_rows());
  if (qkv.dtype() == DType::F64)
    fail(ErrorKind::Shape, op, ": f64 is not supported (the ring runs in float; f64 attention uses all_gather)");
  const int64_t K = round16(d.T);
  return {d, split, rank, src, 2 * d.KV * d.D, round16(d.D), K / 16 % 2 ? K : K + 16};
}

template <class S>
void forward_impl(const Step& w, const S* pqkv, const S* pkv, float* po, float* plse) {
  const auto& d = w.d;
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const int64_t T = d.T, Dp = w.Dp, Kp = w.Kp;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H, g = d.kv_head(h);
    float* q = cpu::thread_scratch<float, cpu::kScratchA>(
        size_t(3 * T * Dp + Dp * Kp + kQBlock * Kp + kQBlock * Dp + kQBlock));
    float* k = q + T * Dp;
    float* v = k + T * Dp;
    float* kt = v + T * Dp;         // (Dp, Kp)
    float* sc = kt + Dp * Kp;       // a query block's scores (kQBlock, Kp)
    float* ob = sc + kQBlock * Kp;  // its partial outputs (kQBlock, Dp)
    float* lb = ob + kQBlock * Dp;  // and their log-sum-exps (kQBlock)
    gather_rows(pqkv + b * T * d.W + d.q_off(h), d.W, T, d.D, Dp, q);
    gather_rows(pkv + b * T * w.kvw + g * d.D, w.kvw, T, d.D, Dp, k);
    gather_rows(pkv + b * T * w.kvw + (d.KV + g) * d.D, w.kvw, T, d.D, Dp, v);
    transpose_rows(k, T, Dp, Kp, kt);
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
      t1 = cpu::cp_attention_blocked::block_end(w.split, t0);
      const int64_t m = t1 - t0, p0 = w.split.position(w.rank, t0), n = w.seen(p0 + m - 1), np = round16(n);
      if (n == 0) continue;  // the block is wholly masked (a higher chunk of src)
      gemm16(m, np, Dp, q + t0 * Dp, Dp, 1, kt, Kp, sc, Kp, false);
      for (int64_t r = 0; r < m; ++r) {
        float* s = sc + r * Kp;
        const int64_t i = w.seen(p0 + r) - 1;  // >= 0: a row of a chunk sees all or none of a lower chunk
        const float mx = row_max(s, i, scale);
        const double sum = exp_row(s, i, np, scale, mx);
        lb[r] = float(double(mx) + std::log(sum));
        const __m256 inv = _mm256_set1_ps(float(1.0 / sum));
        for (int64_t j = 0; j < np; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
      }
      std::fill(ob, ob + m * Dp, 0.f);
      for (int64_t j0 = 0; j0 < n; j0 += kKeyPiece)
        gemm16(m, Dp, std::min(kKeyPiece, n - j0), sc + j0, Kp, 1, v + j0 * Dp, Dp, ob, Dp, Into::Chain);
      for (int64_t r = 0; r < m; ++r)
        merge_row(po + (b * T + t0 + r) * d.C + h * d.D, plse + bh * T + t0 + r, ob + r * Dp, lb[r], d.D);
    }
  }
}

// One task per (batch, key/value head), as cp_attention_blocked.cc's
// backward over the block's keys: dq added into dq_acc per query head, dk
// and dv summed over the group's heads (in double when there are several).
template <class S>
void backward_impl(const Step& w, float* pdq, S* pdkv, const S* pdo, const S* pqkv, const S* pkv, const S* pout,
                   const float* plse) {
  const auto& d = w.d;
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const int64_t G = d.group(), T = d.T, Dp = w.Dp, Kp = w.Kp, TDp = T * Dp;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < d.B * d.KV; ++bg) {
    const int64_t b = bg / d.KV, g = bg % d.KV;
    float* k = cpu::thread_scratch<float, cpu::kScratchA>(
        size_t(7 * TDp + 2 * Dp * Kp + 2 * kQBlock * kPieceLd + kQBlock * Dp + T));
    float* v = k + TDp;
    float* dk = v + TDp;  // the current query head's, by key row
    float* dv = dk + TDp;
    float* qh = dv + TDp;  // the current query head's q, dO and dq, by local row
    float* dO = qh + TDp;
    float* dq = dO + TDp;
    float* kt = dq + TDp;  // (Dp, Kp)
    float* vt = kt + Dp * Kp;
    float* sp = vt + Dp * Kp;  // P, then dS, of a query block's key piece
    float* dp = sp + kQBlock * kPieceLd;
    float* dqb = dp + kQBlock * kPieceLd;
    float* delta = dqb + kQBlock * Dp;
    gather_rows(pkv + b * T * w.kvw + g * d.D, w.kvw, T, d.D, Dp, k);
    gather_rows(pkv + b * T * w.kvw + (d.KV + g) * d.D, w.kvw, T, d.D, Dp, v);
    transpose_rows(k, T, Dp, Kp, kt);
    transpose_rows(v, T, Dp, Kp, vt);
    double* acc = G > 1 ? cpu::thread_scratch<double, cpu::kScratchB>(size_t(2 * TDp)) : nullptr;
    if (acc) std::fill(acc, acc + 2 * TDp, 0.0);
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const int64_t bh = b * d.H + h;
      gather_rows(pqkv + b * T * d.W + d.q_off(h), d.W, T, d.D, Dp, qh);
      gather_rows(pdo + b * T * d.C + h * d.D, d.C, T, d.D, Dp, dO);
      for (int64_t t = 0; t < T; ++t) {  // delta_t = dO_t . O_t, as the all-gather path sums it
        const S* do_row = pdo + (b * T + t) * d.C + h * d.D;
        const S* o_row = pout + (b * T + t) * d.C + h * d.D;
        double s[4] = {0, 0, 0, 0};
        int64_t c = 0;
        for (; c + 4 <= d.D; c += 4)
          for (int l = 0; l < 4; ++l) s[l] += double(load(do_row[c + l])) * double(load(o_row[c + l]));
        for (; c < d.D; ++c) s[0] += double(load(do_row[c])) * double(load(o_row[c]));
        delta[t] = float((s[0] + s[1]) + (s[2] + s[3]));
      }
      std::fill(dk, dk + 2 * TDp, 0.f);
      std::fill(dq, dq + TDp, 0.f);
      for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        t1 = cpu::cp_attention_blocked::block_end(w.split, t0);
        const int64_t m = t1 - t0, p0 = w.split.position(w.rank, t0), n = w.seen(p0 + m - 1), np = round16(n);
        if (n == 0) continue;
        std::fill(dqb, dqb + m * Dp, 0.f);
        for (int64_t j0 = 0; j0 < np; j0 += kKeyPiece) {
          const int64_t w16 = std::min(kKeyPiece, np - j0), nk = std::min(kKeyPiece, n - j0);
          gemm16(m, w16, Dp, qh + t0 * Dp, Dp, 1, kt + j0, Kp, sp, kPieceLd, Into::Set);  // S = Q K^T
          gemm16(m, w16, Dp, dO + t0 * Dp, Dp, 1, vt + j0, Kp, dp, kPieceLd, Into::Set);  // dP = dO V^T
          for (int64_t r = 0; r < m; ++r)  // P = e^(scale S - lse), 0 past the row's prefix
            exp_row(sp + r * kPieceLd, w.seen(p0 + r) - 1 - j0, w16, scale, plse[bh * T + t0 + r]);
          gemm16(nk, Dp, m, sp, 1, kPieceLd, dO + t0 * Dp, Dp, dv + j0 * Dp, Dp, Into::Add);  // dV += P^T dO
          for (int64_t r = 0; r < m; ++r) {  // dS = P (dP - delta) scale
            float* p = sp + r * kPieceLd;
            const float* dpr = dp + r * kPieceLd;
            const __m256 dl = _mm256_set1_ps(delta[t0 + r]), vs = _mm256_set1_ps(scale);
            for (int64_t j = 0; j < w16; j += 8) {
              const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_sub_ps(_mm256_loadu_ps(dpr + j), dl));
              _mm256_storeu_ps(p + j, _mm256_mul_ps(x, vs));
            }
          }
          gemm16(nk, Dp, m, sp, 1, kPieceLd, qh + t0 * Dp, Dp, dk + j0 * Dp, Dp, Into::Add);  // dK += dS^T Q
          gemm16(m, Dp, nk, sp, kPieceLd, 1, k + j0 * Dp, Dp, dqb, Dp, Into::Chain);          // dQ = dS K
        }
        for (int64_t i = 0; i < m * Dp; ++i) dq[t0 * Dp + i] = dqb[i];
      }
      for (int64_t t = 0; t < T; ++t) {
        float* row = pdq + (b * T + t) * d.C + h * d.D;
        for (int64_t c = 0; c < d.D; ++c) row[c] += dq[t * Dp + c];
      }
      if (acc)
        for (int64_t i = 0; i < 2 * TDp; ++i) acc[i] += double(dk[i]);  // dk then dv, contiguous
    }
    for (int64_t t = 0; t < T; ++t) {
      S* dkr = pdkv + (b * T + t) * w.kvw + g * d.D;
      S* dvr = pdkv + (b * T + t) * w.kvw + (d.KV + g) * d.D;
      if (acc) {
        for (int64_t c = 0; c < d.D; ++c) {
          dkr[c] = cpu::store<S>(acc[t * Dp + c]);
          dvr[c] = cpu::store<S>(acc[TDp + t * Dp + c]);
        }
      } else {
        cpu::store_row(dk + t * Dp, dkr, d.D);
        cpu::store_row(dv + t * Dp, dvr, d.D);
      }
    }
  }
}

// F32, BF16, F16: f(S{}).
template <class F>
void dispatch_float_compute(DType t, const char* op, F&& f) {
  cpu::dispatch_storage(t, op, [&](auto tag) {
    using S = decltype(tag);
    if constexpr (!std::is_same_v<S, double>) f(tag);
  });
}

void check_acc(const char* op, const char* what, const Tensor& t, const attention_checks::Dims& d) {
  check_shape(op, what, t, {d.B, d.T, d.C});
  check_dtype(op, what, t, DType::F32);
}

}  // namespace

int64_t cp_ring_keys_seen(const ContextSplit& split, int src, int64_t p) {
  if (split.ranks == 1) return std::clamp<int64_t>(p + 1, 0, split.seq_len);
  const int64_t L = split.chunk();
  int64_t n = 0;
  for (int part = 0; part < 2; ++part) n += std::clamp<int64_t>(p - split.chunk_of(src, part) * L + 1, 0, L);
  return n;
}

void cp_ring_forward_begin(const KernelContext& ctx, Tensor o_acc, Tensor lse) {
  cpu::require_cpu(ctx, "cp_ring_forward_begin");
  check_dtype("cp_ring_forward_begin", "o_acc", o_acc, DType::F32);
  check_dtype("cp_ring_forward_begin", "lse", lse, DType::F32);
  std::fill(o_acc.data<float>(), o_acc.data<float>() + o_acc.numel(), 0.f);
  std::fill(lse.data<float>(), lse.data<float>() + lse.numel(), kNegInf);
}

void cp_ring_forward_step(const KernelContext& ctx, Tensor o_acc, Tensor lse, const Tensor& qkv, const Tensor& kv,
                          const ContextSplit& split, int rank, int src, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  const char* op = "cp_ring_forward_step";
  cpu::require_cpu(ctx, op);
  const Step w = check_step(op, qkv, kv, split, rank, src, n_head, n_kv_head);
  check_acc(op, "o_acc", o_acc, w.d);
  check_shape(op, "lse", lse, {w.d.B, w.d.H, w.d.T});
  check_dtype(op, "lse", lse, DType::F32);
  if (w.d.B == 0) return;
  dispatch_float_compute(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    forward_impl(w, qkv.data<S>(), kv.data<S>(), o_acc.data<float>(), lse.data<float>());
  });
}

void cp_ring_forward_end(const KernelContext& ctx, Tensor out, const Tensor& o_acc) {
  const char* op = "cp_ring_forward_end";
  cpu::require_cpu(ctx, op);
  check_shape(op, "o_acc", o_acc, out.shape());
  check_dtype(op, "o_acc", o_acc, DType::F32);
  dispatch_float_compute(out.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    cpu::store_row(o_acc.data<float>(), out.data<S>(), out.numel());
  });
}

void cp_ring_backward_begin(const KernelContext& ctx, Tensor dq_acc) {
  cpu::require_cpu(ctx, "cp_ring_backward_begin");
  check_dtype("cp_ring_backward_begin", "dq_acc", dq_acc, DType::F32);
  std::fill(dq_acc.data<float>(), dq_acc.data<float>() + dq_acc.numel(), 0.f);
}

void cp_ring_backward_step(const KernelContext& ctx, Tensor dq_acc, Tensor dkv, const Tensor& dout,
                           const Tensor& qkv, const Tensor& kv, const Tensor& out, const Tensor& lse,
                           const ContextSplit& split, int rank, int src, int n_head, int n_kv_head) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Attention);
  const char* op = "cp_ring_backward_step";
  cpu::require_cpu(ctx, op);
  const Step w = check_step(op, qkv, kv, split, rank, src, n_head, n_kv_head);
  check_acc(op, "dq_acc", dq_acc, w.d);
  check_shape(op, "dkv", dkv, kv.shape());
  check_dtype(op, "dkv", dkv, qkv.dtype());
  for (const auto& [what, t] : {std::pair<const char*, const Tensor*>{"dout", &dout}, {"out", &out}}) {
    check_shape(op, what, *t, {w.d.B, w.d.T, w.d.C});
    check_dtype(op, what, *t, qkv.dtype());
  }
  check_shape(op, "lse", lse, {w.d.B, w.d.H, w.d.T});
  check_dtype(op, "lse", lse, DType::F32);
  if (w.d.B == 0) return;
  dispatch_float_compute(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    backward_impl(w, dq_acc.data<float>(), dkv.data<S>(), dout.data<S>(), qkv.data<S>(), kv.data<S>(),
                  out.data<S>(), lse.data<float>());
  });
}

void cp_ring_backward_end(const KernelContext& ctx, Tensor dqkv, const Tensor& dq_acc, int n_head, int n_kv_head) {
  const char* op = "cp_ring_backward_end";
  cpu::require_cpu(ctx, op);
  const attention_checks::Dims d = attention_checks::check_dims(op, dqkv, n_head, n_kv_head);
  check_acc(op, "dq_acc", dq_acc, d);
  dispatch_float_compute(dqkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    for (int64_t r = 0; r < d.B * d.T; ++r) cpu::store_row(dq_acc.data<float>() + r * d.C, dqkv.data<S>() + r * d.W, d.C);
  });
}

void attention_lse_merge(const KernelContext& ctx, Tensor o_acc, Tensor lse_acc, const Tensor& o_part,
                         const Tensor& lse_part, int n_head) {
  const char* op = "attention_lse_merge";
  cpu::require_cpu(ctx, op);
  if (o_acc.rank() != 3 || n_head <= 0 || o_acc.size(2) % n_head != 0)
    fail(ErrorKind::Shape, op, ": o_acc must be (B, T, n_head D) with n_head ", n_head, ", got ", o_acc.shape().str());
  const int64_t B = o_acc.size(0), T = o_acc.size(1), C = o_acc.size(2), D = C / n_head;
  check_shape(op, "o_part", o_part, o_acc.shape());
  check_shape(op, "lse_acc", lse_acc, {B, n_head, T});
  check_shape(op, "lse_part", lse_part, {B, n_head, T});
  const Tensor* operands[] = {&o_acc, &lse_acc, &o_part, &lse_part};
  for (const Tensor* t : operands) check_dtype(op, "operand", *t, DType::F32);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < n_head; ++h)
      for (int64_t t = 0; t < T; ++t)
        merge_row(o_acc.data<float>() + (b * T + t) * C + h * D, lse_acc.data<float>() + (b * n_head + h) * T + t,
                  o_part.data<float>() + (b * T + t) * C + h * D, lse_part.data<float>()[(b * n_head + h) * T + t],
                  D);
}

}  // namespace xirang
