// Context-parallel attention's blocked float path (see cp_attention_blocked.h).
//
// As attention_blocked.cc with three changes. Keys: a task gathers its
// key/value head's k and v rows from kv_all in global position order for
// positions [0, P), P = the rank's last position + 1 (later ones are never
// seen), zero-padded to Dp columns and transposed to (Dp, Pp). Queries: a
// block is up to kQBlock local rows that do not cross the boundary between
// the rank's two chunks, so its rows are consecutive positions p0 .. p0+m-1
// and the block sees keys [0, p0+m); row r's mask is its position p0 + r.
// With c = 1 and T a multiple of kQBlock the blocks, products and sums are
// those of the one-rank path; otherwise forward still matches it bitwise
// (the extra keys a block multiplies are exact zeros) while backward's dk
// and dv sum over differently cut blocks (equal up to rounding). Long
// rows: backward, and forward's P V, take a block's keys in pieces of
// kKeyPiece so that what the block touches stays in L2; every sum keeps
// its order (sums over keys continue their chains across pieces,
// attention_tiles.h's Into::Chain), so the bits are those of uncut products.
#include "kernels/cpu/cp_attention_blocked.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/common.h"

namespace xirang::cpu::cp_attention_blocked {

using cp_attention_checks::CpDims;
using namespace attention_tiles;

namespace {

// Keys per piece of a query block's long rows. A block's work touches its
// keys' k, v (both ways round), dk and dv, 1.5 KiB a key (D 64): at a few
// thousand keys the block outgrows the 2 MiB L2, and rank 0 (whose tail
// chunk sees every key) ran 3-5% slower than the mean on equal work, up to
// 15% in CPU time while other work shared the L3 (docs/performance.md). In
// pieces of 512 (768 KiB) each key is read from L3 once per block.
constexpr int64_t kKeyPiece = 512;
// A piece's score rows are this far apart: an odd multiple of 16 floats, so
// a column of 32 rows does not fall in a few cache sets (as 512 would).
constexpr int64_t kPieceLd = kKeyPiece + 16;

// The rank's view: positions reachable (P), chunk length, padded widths.
// Pp, the row length of the transposed keys and of the score blocks, is P
// rounded up to an odd multiple of 16: with P a power of two (or a multiple
// of a large one) the rows would all fall in the same cache sets, and the
// ranks whose P is such ran 1.2 to 1.5 x slower (the row length does not
// change any sum).
struct View {
  const CpDims& cd;
  const ContextSplit& split;
  int rank;
  int64_t P, L, Dp, Pp;
  View(const CpDims& c, const ContextSplit& s, int r)
      : cd(c), split(s), rank(r), P(s.position(r, c.d.T - 1) + 1), L(s.chunk()), Dp(round16(c.d.D)),
        Pp(round16(P) / 16 % 2 ? round16(P) : round16(P) + 16) {}
  int64_t block_end(int64_t t0) const { return cp_attention_blocked::block_end(split, t0); }
};

// Key/value head g's k and v at positions [0, P) of batch b as float rows of Dp.
template <class S>
void gather_kv(const View& w, const S* pkv, int64_t b, int64_t g, float* k, float* v) {
  const auto& d = w.cd.d;
  for (int64_t p = 0; p < w.P; ++p) {
    int owner;
    const int64_t r = w.split.local_row(p, &owner);
    const S* row = pkv + ((int64_t(owner) * d.B + b) * d.T + r) * w.cd.kvw;
    gather_rows(row + g * d.D, 0, 1, d.D, w.Dp, k + p * w.Dp);
    gather_rows(row + (d.KV + g) * d.D, 0, 1, d.D, w.Dp, v + p * w.Dp);
  }
}

}  // namespace

int64_t block_end(const ContextSplit& split, int64_t t0) {
  const int64_t T = split.local_rows(), L = split.chunk();
  return std::min(t0 + kQBlock, t0 < L ? std::min(L, T) : T);
}

int64_t computed_pairs(const ContextSplit& split, int rank) {
  int64_t pairs = 0;
  for (int64_t t0 = 0, t1; t0 < split.local_rows(); t0 = t1) {
    t1 = block_end(split, t0);
    pairs += (t1 - t0) * round16(split.position(rank, t0) + t1 - t0);
  }
  return pairs;
}

template <class S>
void forward(const CpDims& cd, const ContextSplit& split, int rank, const S* pqkv, const S* pkv, S* pout,
             float* plse) {
  const auto& d = cd.d;
  const View w(cd, split, rank);
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const int64_t Dp = w.Dp, Pp = w.Pp, T = d.T;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    float* q = cpu::thread_scratch<float, cpu::kScratchA>(
        size_t(T * Dp + 2 * w.P * Dp + Dp * Pp + kQBlock * Pp + kQBlock * Dp));
    float* k = q + T * Dp;
    float* v = k + w.P * Dp;
    float* kt = v + w.P * Dp;       // (Dp, Pp)
    float* sc = kt + Dp * Pp;       // scores of a query block (kQBlock, Pp)
    float* ob = sc + kQBlock * Pp;  // its outputs (kQBlock, Dp)
    gather_rows(pqkv + b * T * d.W + d.q_off(h), d.W, T, d.D, Dp, q);
    gather_kv(w, pkv, b, d.kv_head(h), k, v);
    transpose_rows(k, w.P, Dp, Pp, kt);
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
      t1 = w.block_end(t0);
      const int64_t m = t1 - t0, p0 = split.position(rank, t0), n = p0 + m, np = round16(n);
      gemm16(m, np, Dp, q + t0 * Dp, Dp, 1, kt, Pp, sc, Pp, false);
      for (int64_t r = 0; r < m; ++r) {
        float* s = sc + r * Pp;
        const float mx = row_max(s, p0 + r, scale);
        const double sum = exp_row(s, p0 + r, np, scale, mx);
        plse[bh * T + t0 + r] = float(double(mx) + std::log(sum));
        const __m256 inv = _mm256_set1_ps(float(1.0 / sum));
        for (int64_t j = 0; j < np; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
      }
      std::fill(ob, ob + m * Dp, 0.f);  // O = P V, its sums over the keys cut into pieces
      for (int64_t j0 = 0; j0 < n; j0 += kKeyPiece)
        gemm16(m, Dp, std::min(kKeyPiece, n - j0), sc + j0, Pp, 1, v + j0 * Dp, Dp, ob, Dp, Into::Chain);
      for (int64_t r = 0; r < m; ++r) cpu::store_row(ob + r * Dp, pout + (b * T + t0 + r) * d.C + h * d.D, d.D);
    }
  }
}

// One task per (batch, key/value head): each query head's dq is written as
// it finishes; the heads' dk and dv (per head in float, by position) are
// summed over the group in double, then written to every rank's rows of
// dkv_all (zero at positions P and later, which no local query sees).
template <class S>
void backward(const CpDims& cd, const ContextSplit& split, int rank, S* pdq, S* pdkv, const S* pdo, const S* pqkv,
              const S* pkv, const S* pout, const float* plse) {
  const auto& d = cd.d;
  const View w(cd, split, rank);
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const int64_t G = d.group(), T = d.T, Dp = w.Dp, Pp = w.Pp, TDp = T * Dp, PDp = w.P * Dp;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < d.B * d.KV; ++bg) {
    const int64_t b = bg / d.KV, g = bg % d.KV;
    float* k = cpu::thread_scratch<float, cpu::kScratchA>(
        size_t(4 * PDp + 3 * TDp + 2 * Dp * Pp + 2 * kQBlock * kPieceLd + kQBlock * Dp + T));
    float* v = k + PDp;
    float* dk = v + PDp;  // the current query head's, by position
    float* dv = dk + PDp;
    float* qh = dv + PDp;  // the current query head's q, dO and dq, by local row
    float* dO = qh + TDp;
    float* dq = dO + TDp;
    float* kt = dq + TDp;  // (Dp, Pp)
    float* vt = kt + Dp * Pp;
    float* sp = vt + Dp * Pp;  // P, then dS, of a query block's key piece (kQBlock, kPieceLd)
    float* dp = sp + kQBlock * kPieceLd;
    float* dqb = dp + kQBlock * kPieceLd;  // the block's dQ (kQBlock, Dp)
    float* delta = dqb + kQBlock * Dp;
    gather_kv(w, pkv, b, g, k, v);
    transpose_rows(k, w.P, Dp, Pp, kt);
    transpose_rows(v, w.P, Dp, Pp, vt);
    double* acc = G > 1 ? cpu::thread_scratch<double, cpu::kScratchB>(size_t(2 * PDp)) : nullptr;
    if (acc) std::fill(acc, acc + 2 * PDp, 0.0);
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const int64_t bh = b * d.H + h;
      gather_rows(pqkv + b * T * d.W + d.q_off(h), d.W, T, d.D, Dp, qh);
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
      std::fill(dk, dk + 2 * PDp, 0.f);
      std::fill(dq, dq + TDp, 0.f);
      for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        t1 = w.block_end(t0);
        const int64_t m = t1 - t0, p0 = split.position(rank, t0), n = p0 + m, np = round16(n);
        std::fill(dqb, dqb + m * Dp, 0.f);
        for (int64_t j0 = 0; j0 < np; j0 += kKeyPiece) {  // keys j0 .. j0 + nk (w16: nk rounded up to 16)
          const int64_t w16 = std::min(kKeyPiece, np - j0), nk = std::min(kKeyPiece, n - j0);
          gemm16(m, w16, Dp, qh + t0 * Dp, Dp, 1, kt + j0, Pp, sp, kPieceLd, Into::Set);  // S = Q K^T
          gemm16(m, w16, Dp, dO + t0 * Dp, Dp, 1, vt + j0, Pp, dp, kPieceLd, Into::Set);  // dP = dO V^T
          for (int64_t r = 0; r < m; ++r)  // P = e^(scale S - lse), 0 after the query's position
            exp_row(sp + r * kPieceLd, p0 + r - j0, w16, scale, plse[bh * T + t0 + r]);
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
        // dq's rows start at zero: adding the chains gives the bits of one product over all the keys.
        for (int64_t i = 0; i < m * Dp; ++i) dq[t0 * Dp + i] += dqb[i];
      }
      for (int64_t t = 0; t < T; ++t) cpu::store_row(dq + t * Dp, pdq + (b * T + t) * d.W + d.q_off(h), d.D);
      if (acc)
        for (int64_t i = 0; i < 2 * PDp; ++i) acc[i] += double(dk[i]);  // dk then dv, contiguous
    }
    // Every rank's rows of this (batch, key/value head), in kv_all's layout.
    for (int64_t r = 0; r < cd.c; ++r)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p = split.position(int(r), t);
        S* row = pdkv + ((r * d.B + b) * T + t) * cd.kvw;
        S* dkr = row + g * d.D;
        S* dvr = row + (d.KV + g) * d.D;
        if (p >= w.P) {
          std::fill(dkr, dkr + d.D, S{});
          std::fill(dvr, dvr + d.D, S{});
        } else if (acc) {
          for (int64_t c = 0; c < d.D; ++c) {
            dkr[c] = cpu::store<S>(acc[p * Dp + c]);
            dvr[c] = cpu::store<S>(acc[PDp + p * Dp + c]);
          }
        } else {
          cpu::store_row(dk + p * Dp, dkr, d.D);
          cpu::store_row(dv + p * Dp, dvr, d.D);
        }
      }
  }
}

template void forward<float>(const CpDims&, const ContextSplit&, int, const float*, const float*, float*, float*);
template void forward<bf16>(const CpDims&, const ContextSplit&, int, const bf16*, const bf16*, bf16*, float*);
template void forward<f16>(const CpDims&, const ContextSplit&, int, const f16*, const f16*, f16*, float*);
template void backward<float>(const CpDims&, const ContextSplit&, int, float*, float*, const float*, const float*,
                              const float*, const float*, const float*);
template void backward<bf16>(const CpDims&, const ContextSplit&, int, bf16*, bf16*, const bf16*, const bf16*,
                             const bf16*, const bf16*, const float*);
template void backward<f16>(const CpDims&, const ContextSplit&, int, f16*, f16*, const f16*, const f16*, const f16*,
                            const f16*, const float*);

}  // namespace xirang::cpu::cp_attention_blocked
