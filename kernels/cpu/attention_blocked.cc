// The flash attention pair's blocked float path (see attention_blocked.h).
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
#include "kernels/cpu/attention_blocked.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/common.h"

namespace xirang::cpu::attention_blocked {

using attention_checks::Dims;

using namespace attention_tiles;

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

template void forward<float>(const Dims&, const float*, float*, float*);
template void forward<bf16>(const Dims&, const bf16*, bf16*, float*);
template void forward<f16>(const Dims&, const f16*, f16*, float*);
template void backward<float>(const Dims&, float*, const float*, const float*, const float*, const float*);
template void backward<bf16>(const Dims&, bf16*, const bf16*, const bf16*, const bf16*, const float*);
template void backward<f16>(const Dims&, f16*, const f16*, const f16*, const f16*, const float*);

}  // namespace xirang::cpu::attention_blocked
