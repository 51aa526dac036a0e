// CUDA causal flash attention: storage S in {f32, bf16, f16}, arithmetic
// and accumulation in float (CUDA cores; no tensor cores). The reference
// and the fallback of the tensor-core kernels (attention_tc.cu), which the
// public entry points at the end of this file pick for bf16 and f16. Grouped-query
// attention: H query heads share KV key/value heads (kernels/attention.h);
// a qkv row is W = (H + 2 KV) D wide, query head h reads key/value head
// h / (H / KV).
//
// Forward: one block per (64 query rows, batch, head). Q stays in shared
// memory while the block walks the key/value tiles up to the diagonal,
// keeping the online-softmax state (row max m, row sum l, unnormalised
// output O) in registers; it writes out = O / l and lse = log-sum-exp of
// the scaled scores, so nothing of size T^2 ever reaches global memory.
//
// Backward recomputes P = exp(S - lse) tile by tile and writes dqkv without
// atomics, so it is deterministic:
//   1. rowdot[b, h, t] = dout_t . out_t (the softmax-backward row term),
//      into the context's workspace (B*H*T floats);
//   2. one block per (64 key rows, b, key/value head) walks, for each query
//      head of its group in turn, the query tiles at or below the diagonal
//      and accumulates dK = scale dS^T Q and dV = P^T dO (so the sum over
//      the group's query heads needs no atomics either). With few
//      key/value heads this is B * KV * T / 64 blocks, each doing H / KV
//      heads' work: fewer blocks than SMs for multi-query attention at small
//      B and T; per-head partial sums in the workspace, reduced in a fixed
//      order, would restore the parallelism without giving up determinism;
//   3. one block per (64 query rows, b, h) walks the key tiles and
//      accumulates dQ = scale dS K, with dS = P (dP - rowdot), dP = dO V^T.
// S and dP are recomputed in both 2 and 3: the price of having each output
// element owned by one block.
//
// Thread layout: 256 threads as a 16 x 16 grid (ty = tid / 16, tx = tid %
// 16). A score tile (64 x 64) gives thread (ty, tx) rows ty + 16 i and
// columns tx + 16 j (i, j < 4); an accumulator tile (64 rows x head dim)
// gives it rows ty + 16 i and head columns tx + 16 j. A row's 16 owners are
// the 16 adjacent lanes of one half-warp, so row reductions are 4 shuffles.
//
// Shared-memory tiles of Q, K, V, dO are float (64, DMAX + 1): the odd
// stride puts the 16 rows that one instruction reads in 16 different banks.
// P and dS tiles use stride 80 (= 16 mod 32), so the two rows a warp touches
// fall in different bank halves. The head dim D is padded up to DMAX in
// {16, 32, 64, 128} with zeros, which add nothing to any dot product.
#include <math_constants.h>

#include <cmath>
#include <type_traits>
#include <utility>

#include "kernels/attention.h"
#include "kernels/attention_checks.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace xirang::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;          // query rows and key rows per tile
constexpr int kPer = kTile / 16;   // tile rows (or columns) per thread
constexpr int kLdP = kTile + 16;   // row stride of the P and dS tiles
constexpr int kMaxHeadDim = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Max and sum over the 16 lanes that own one score row.
__device__ __forceinline__ float row_max16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float row_sum16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// tile (ROWS, DMAX + 1) <- rows [row0, row0 + ROWS) of a D-wide head slice
// starting at src, rows `stride` elements apart; rows at or past T and
// columns at or past D are zero.
template <int ROWS, int DMAX, class S>
__device__ __forceinline__ void load_tile(float* tile, const S* __restrict__ src, int64_t stride, int64_t row0,
                                          int64_t T, int D) {
  for (int idx = threadIdx.x; idx < ROWS * DMAX; idx += kThreads) {
    const int r = idx / DMAX, d = idx % DMAX;
    const int64_t t = row0 + r;
    tile[r * (DMAX + 1) + d] = (t < T && d < D) ? load(src[t * stride + d]) : 0.f;
  }
}

// acc[i][j] = a[ty + 16 i, :D] . b[tx + 16 j, :D] for two (kTile, DMAX + 1) tiles.
template <int DMAX>
__device__ __forceinline__ void tile_dot(float (&acc)[kPer][kPer], const float* a, const float* b, int ty, int tx,
                                         int D) {
  constexpr int LD = DMAX + 1;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[i][j] = 0.f;
#pragma unroll 4
  for (int d = 0; d < D; ++d) {
    float av[kPer], bv[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) av[i] = a[(ty + 16 * i) * LD + d];
#pragma unroll
    for (int j = 0; j < kPer; ++j) bv[j] = b[(tx + 16 * j) * LD + d];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

template <int DMAX>
constexpr size_t forward_smem_bytes() {
  return sizeof(float) * (3 * kTile * (DMAX + 1) + kTile * kLdP);
}
template <int DMAX>
constexpr size_t dkdv_smem_bytes() {
  return sizeof(float) * (4 * kTile * (DMAX + 1) + 2 * kTile * kLdP + 2 * kTile);
}
template <int DMAX>
constexpr size_t dq_smem_bytes() {
  return sizeof(float) * (4 * kTile * (DMAX + 1) + kTile * kLdP + 2 * kTile);
}

// grid (query tiles, B * H); query tiles are taken last first, since the
// tiles near the end of the sequence have the most key tiles to visit.
template <class S, int DMAX>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(S* __restrict__ out, float* __restrict__ lse, const S* __restrict__ qkv, int64_t T, int W,
                         int H, int KV, int D, float scale_log2) {
  constexpr int LD = DMAX + 1, DPT = DMAX / 16;
  extern __shared__ float smem[];
  float* Qs = smem;               // (kTile, LD)
  float* Ks = Qs + kTile * LD;    // (kTile, LD)
  float* Vs = Ks + kTile * LD;    // (kTile, LD)
  float* Ps = Vs + kTile * LD;    // (kTile, kLdP): this tile's exp(S - m)
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int qt = int(gridDim.x) - 1 - int(blockIdx.x);
  const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / KV);
  const int64_t q0 = int64_t(qt) * kTile, C = int64_t(H) * D;
  const S* row0 = qkv + int64_t(b) * T * W;
  const S* qbase = row0 + int64_t(h) * D;           // q of head h, token 0
  const S* kbase = row0 + C + int64_t(g) * D;       // k of its key/value head
  const S* vbase = kbase + int64_t(KV) * D;         // v of its key/value head
  load_tile<kTile, DMAX>(Qs, qbase, W, q0, T, D);

  // Per owned row: running max m (log2 units), running sum l, and O.
  float o[kPer][DPT], m[kPer], l[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.f;
#pragma unroll
    for (int dd = 0; dd < DPT; ++dd) o[i][dd] = 0.f;
  }

  // Key tiles 0 .. qt: with equal tile heights the diagonal tile is qt.
  for (int kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = int64_t(kt) * kTile;
    __syncthreads();  // the previous tile's K, V and P are no longer read
    load_tile<kTile, DMAX>(Ks, kbase, W, k0, T, D);
    load_tile<kTile, DMAX>(Vs, vbase, W, k0, T, D);
    __syncthreads();
    float s[kPer][kPer];
    tile_dot<DMAX>(s, Qs, Ks, ty, tx, D);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int r = ty + 16 * i;
      const int64_t qi = q0 + r;
      float mx = -CUDART_INF_F;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int64_t kj = k0 + tx + 16 * j;
        // Causal mask. Keys at or past T only occur above the diagonal of
        // real rows; rows at or past T are computed but never written.
        s[i][j] = kj <= qi ? s[i][j] * scale_log2 : -CUDART_INF_F;
        mx = fmaxf(mx, s[i][j]);
      }
      const float m_new = fmaxf(m[i], row_max16(mx));
      // Every row has key 0 (or the tile's first key) unmasked, so m_new is
      // finite; the guard keeps an all-masked row at exact zeros anyway.
      const float ref = m_new == -CUDART_INF_F ? 0.f : m_new;
      const float alpha = exp2f(m[i] - ref);  // 0 on the first tile
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const float p = exp2f(s[i][j] - ref);
        sum += p;
        Ps[r * kLdP + tx + 16 * j] = p;
      }
      l[i] = l[i] * alpha + row_sum16(sum);
      m[i] = m_new;
#pragma unroll
      for (int dd = 0; dd < DPT; ++dd) o[i][dd] *= alpha;
    }
    __syncthreads();
    // O += P V over this tile's keys.
#pragma unroll 4
    for (int c = 0; c < kTile; ++c) {
      float pv[kPer], vv[DPT];
#pragma unroll
      for (int i = 0; i < kPer; ++i) pv[i] = Ps[(ty + 16 * i) * kLdP + c];
#pragma unroll
      for (int dd = 0; dd < DPT; ++dd) vv[dd] = Vs[c * LD + tx + 16 * dd];
#pragma unroll
      for (int i = 0; i < kPer; ++i)
#pragma unroll
        for (int dd = 0; dd < DPT; ++dd) o[i][dd] = fmaf(pv[i], vv[dd], o[i][dd]);
    }
  }

#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t qi = q0 + ty + 16 * i;
    if (qi >= T) continue;
    const float inv = 1.f / l[i];
    S* orow = out + (int64_t(b) * T + qi) * C + int64_t(h) * D;
#pragma unroll
    for (int dd = 0; dd < DPT; ++dd) {
      const int d = tx + 16 * dd;
      if (d < D) orow[d] = store<S>(o[i][dd] * inv);
    }
    if (tx == 0) lse[int64_t(bh) * T + qi] = (m[i] + log2f(l[i])) * kLn2;
  }
}

// rowdot[b, h, t] = dout[b, t, h, :] . out[b, t, h, :]; one warp per (b, t, h),
// in memory order of out, whose row r = (b T + t) H + h starts at r D.
template <class S>
__global__ void __launch_bounds__(kThreads)
    flash_backward_rowdot_kernel(float* __restrict__ rowdot, const S* __restrict__ dout, const S* __restrict__ out,
                                 int64_t rows, int64_t T, int H, int D) {
  const int64_t r = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (r >= rows) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const S* g = dout + r * D;
  const S* o = out + r * D;
  float s = 0.f;
  for (int d = lane; d < D; d += 32) s += load(g[d]) * load(o[d]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) {
    const int64_t bt = r / H, b = bt / T, t = bt % T;
    const int h = int(r % H);
    rowdot[(b * H + h) * T + t] = s;
  }
}

// Loads lse (scaled to log2 units) and the row term for query rows
// [q0, q0 + kTile) of head bh; zeros past T.
__device__ __forceinline__ void load_row_stats(float* lse_s, float* dv_s, const float* __restrict__ lse,
                                               const float* __restrict__ rowdot, int64_t bh, int64_t q0, int64_t T) {
  for (int r = threadIdx.x; r < kTile; r += kThreads) {
    const int64_t t = q0 + r;
    lse_s[r] = t < T ? lse[bh * T + t] * kLog2e : 0.f;
    dv_s[r] = t < T ? rowdot[bh * T + t] : 0.f;
  }
}

// grid (key tiles, B * KV): dK and dV of 64 key rows of one key/value
// head, summed over the query heads of its group.
template <class S, int DMAX>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dkdv_kernel(S* __restrict__ dqkv, const S* __restrict__ qkv, const S* __restrict__ dout,
                               const float* __restrict__ lse, const float* __restrict__ rowdot, int64_t T, int W, int H,
                               int KV, int D, float scale, float scale_log2) {
  constexpr int LD = DMAX + 1, DPT = DMAX / 16;
  extern __shared__ float smem[];
  float* Ks = smem;                 // (kTile, LD)
  float* Vs = Ks + kTile * LD;      // (kTile, LD)
  float* Qs = Vs + kTile * LD;      // (kTile, LD)
  float* Gs = Qs + kTile * LD;      // (kTile, LD): dO
  float* Ps = Gs + kTile * LD;      // (kTile, kLdP), rows = queries, columns = keys
  float* dSs = Ps + kTile * kLdP;   // (kTile, kLdP)
  float* lse_s = dSs + kTile * kLdP;  // (kTile)
  float* dv_s = lse_s + kTile;        // (kTile)
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int kt = blockIdx.x;
  const int bg = blockIdx.y, b = bg / KV, g = bg % KV, G = H / KV;
  const int64_t k0 = int64_t(kt) * kTile, C = int64_t(H) * D;
  const S* row0 = qkv + int64_t(b) * T * W;
  const int64_t k_off = C + int64_t(g) * D, v_off = k_off + int64_t(KV) * D;  // in a qkv row
  load_tile<kTile, DMAX>(Ks, row0 + k_off, W, k0, T, D);
  load_tile<kTile, DMAX>(Vs, row0 + v_off, W, k0, T, D);

  // Accumulators for key rows ty + 16 i, head columns tx + 16 dd.
  float dk[kPer][DPT], dvv[kPer][DPT];
#pragma unroll
  for (int i = 0; i < kPer; ++i)
#pragma unroll
    for (int dd = 0; dd < DPT; ++dd) dk[i][dd] = dvv[i][dd] = 0.f;

  // For each query head of the group, query tiles from the diagonal down
  // (earlier queries never see these keys) to the last; there are as many
  // query tiles as key tiles.
  for (int h = g * G; h < (g + 1) * G; ++h) {
    const int64_t bh = int64_t(b) * H + h;
    const S* qbase = row0 + int64_t(h) * D;
    const S* gbase = dout + int64_t(b) * T * C + int64_t(h) * D;
    for (int qt = kt; qt < int(gridDim.x); ++qt) {
      const int64_t q0 = int64_t(qt) * kTile;
      __syncthreads();  // the previous tile's Q, dO, P, dS are no longer read
      load_tile<kTile, DMAX>(Qs, qbase, W, q0, T, D);
      load_tile<kTile, DMAX>(Gs, gbase, C, q0, T, D);
      load_row_stats(lse_s, dv_s, lse, rowdot, bh, q0, T);
      __syncthreads();
      float s[kPer][kPer], dp[kPer][kPer];
      tile_dot<DMAX>(s, Qs, Ks, ty, tx, D);   // rows: queries, columns: keys
      tile_dot<DMAX>(dp, Gs, Vs, ty, tx, D);  // dP = dO V^T
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int r = ty + 16 * i;
        const int64_t qi = q0 + r;
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int c = tx + 16 * j;
          const int64_t kj = k0 + c;
          const float p = (qi < T && kj <= qi) ? exp2f(s[i][j] * scale_log2 - lse_s[r]) : 0.f;
          Ps[r * kLdP + c] = p;
          dSs[r * kLdP + c] = p * (dp[i][j] - dv_s[r]);
        }
      }
      __syncthreads();
      // dV += P^T dO, dK += dS^T Q (scaled at the end), over this tile's queries.
#pragma unroll 2
      for (int r = 0; r < kTile; ++r) {
        float pr[kPer], dsr[kPer], gv[DPT], qv[DPT];
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          pr[i] = Ps[r * kLdP + ty + 16 * i];
          dsr[i] = dSs[r * kLdP + ty + 16 * i];
        }
#pragma unroll
        for (int dd = 0; dd < DPT; ++dd) {
          gv[dd] = Gs[r * LD + tx + 16 * dd];
          qv[dd] = Qs[r * LD + tx + 16 * dd];
        }
#pragma unroll
        for (int i = 0; i < kPer; ++i)
#pragma unroll
          for (int dd = 0; dd < DPT; ++dd) {
            dvv[i][dd] = fmaf(pr[i], gv[dd], dvv[i][dd]);
            dk[i][dd] = fmaf(dsr[i], qv[dd], dk[i][dd]);
          }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t kj = k0 + ty + 16 * i;
    if (kj >= T) continue;
    S* row = dqkv + (int64_t(b) * T + kj) * W;
#pragma unroll
    for (int dd = 0; dd < DPT; ++dd) {
      const int d = tx + 16 * dd;
      if (d >= D) continue;
      row[k_off + d] = store<S>(dk[i][dd] * scale);
      row[v_off + d] = store<S>(dvv[i][dd]);
    }
  }
}

// grid (query tiles, B * H), last tiles first: dQ of 64 query rows of one head.
template <class S, int DMAX>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dq_kernel(S* __restrict__ dqkv, const S* __restrict__ qkv, const S* __restrict__ dout,
                             const float* __restrict__ lse, const float* __restrict__ rowdot, int64_t T, int W, int H,
                             int KV, int D, float scale, float scale_log2) {
  constexpr int LD = DMAX + 1, DPT = DMAX / 16;
  extern __shared__ float smem[];
  float* Qs = smem;                   // (kTile, LD)
  float* Gs = Qs + kTile * LD;        // (kTile, LD): dO
  float* Ks = Gs + kTile * LD;        // (kTile, LD)
  float* Vs = Ks + kTile * LD;        // (kTile, LD)
  float* dSs = Vs + kTile * LD;       // (kTile, kLdP), rows = queries, columns = keys
  float* lse_s = dSs + kTile * kLdP;  // (kTile)
  float* dv_s = lse_s + kTile;        // (kTile)
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int qt = int(gridDim.x) - 1 - int(blockIdx.x);
  const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / KV);
  const int64_t q0 = int64_t(qt) * kTile, C = int64_t(H) * D;
  const S* row0 = qkv + int64_t(b) * T * W;
  const S* kbase = row0 + C + int64_t(g) * D;  // k of its key/value head
  const S* vbase = kbase + int64_t(KV) * D;
  load_tile<kTile, DMAX>(Qs, row0 + int64_t(h) * D, W, q0, T, D);
  load_tile<kTile, DMAX>(Gs, dout + int64_t(b) * T * C + int64_t(h) * D, C, q0, T, D);
  load_row_stats(lse_s, dv_s, lse, rowdot, bh, q0, T);

  float dq[kPer][DPT];
#pragma unroll
  for (int i = 0; i < kPer; ++i)
#pragma unroll
    for (int dd = 0; dd < DPT; ++dd) dq[i][dd] = 0.f;

  for (int kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = int64_t(kt) * kTile;
    __syncthreads();  // the previous tile's K, V, dS are no longer read
    load_tile<kTile, DMAX>(Ks, kbase, W, k0, T, D);
    load_tile<kTile, DMAX>(Vs, vbase, W, k0, T, D);
    __syncthreads();
    float s[kPer][kPer], dp[kPer][kPer];
    tile_dot<DMAX>(s, Qs, Ks, ty, tx, D);
    tile_dot<DMAX>(dp, Gs, Vs, ty, tx, D);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int r = ty + 16 * i;
      const int64_t qi = q0 + r;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int c = tx + 16 * j;
        const int64_t kj = k0 + c;
        const float p = (qi < T && kj <= qi) ? exp2f(s[i][j] * scale_log2 - lse_s[r]) : 0.f;
        dSs[r * kLdP + c] = p * (dp[i][j] - dv_s[r]);
      }
    }
    __syncthreads();
    // dQ += dS K (scaled at the end).
#pragma unroll 4
    for (int c = 0; c < kTile; ++c) {
      float dsr[kPer], kv[DPT];
#pragma unroll
      for (int i = 0; i < kPer; ++i) dsr[i] = dSs[(ty + 16 * i) * kLdP + c];
#pragma unroll
      for (int dd = 0; dd < DPT; ++dd) kv[dd] = Ks[c * LD + tx + 16 * dd];
#pragma unroll
      for (int i = 0; i < kPer; ++i)
#pragma unroll
        for (int dd = 0; dd < DPT; ++dd) dq[i][dd] = fmaf(dsr[i], kv[dd], dq[i][dd]);
    }
  }

#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t qi = q0 + ty + 16 * i;
    if (qi >= T) continue;
    S* row = dqkv + (int64_t(b) * T + qi) * W + int64_t(h) * D;
#pragma unroll
    for (int dd = 0; dd < DPT; ++dd) {
      const int d = tx + 16 * dd;
      if (d < D) row[d] = store<S>(dq[i][dd] * scale);
    }
  }
}

template <class S>
S* tensor_ptr(const Tensor& t) {  // callers have checked t's dtype against S
  return static_cast<S*>(t.raw());
}

using attention_checks::Dims;

// The shared shape checks, plus the CUDA kernels' own limits.
Dims check_dims(const char* op, const Tensor& qkv, int n_head, int n_kv_head) {
  const Dims d = attention_checks::check_dims(op, qkv, n_head, n_kv_head);
  if (d.D > kMaxHeadDim) fail(ErrorKind::Shape, op, ": head dim ", d.D, " exceeds ", kMaxHeadDim, " on CUDA");
  if (d.B * d.H > 65535) fail(ErrorKind::Shape, op, ": B * n_head = ", d.B * d.H, " exceeds 65535 (grid y)");
  if (d.W > 0x7fffffff) fail(ErrorKind::Shape, op, ": qkv width ", d.W, " is too large");
  check_on_device(op, {{"qkv", &qkv}});
  return d;
}

// The head dim rounded up to the tile width the kernels are built for.
template <class F>
void dispatch_head_dim(int64_t D, F&& f) {
  if (D <= 16)
    f(std::integral_constant<int, 16>{});
  else if (D <= 32)
    f(std::integral_constant<int, 32>{});
  else if (D <= 64)
    f(std::integral_constant<int, 64>{});
  else
    f(std::integral_constant<int, 128>{});
}

// Lets a kernel use `bytes` of dynamic shared memory (above the 48 KiB
// default; sm_90 allows up to 227 KiB per block).
template <class K>
void allow_smem(K* kernel, size_t bytes) {
  XR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace

void flash_attention_forward_fp32(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                                  int n_kv_head) {
  const char* op = "flash_attention_forward";
  require_cuda(ctx, op);
  const Dims d = check_dims(op, qkv, n_head, n_kv_head);
  check_shape(op, "out", out, {d.B, d.T, d.C});
  check_dtype(op, "out", out, qkv.dtype());
  check_on_device(op, {{"out", &out}});
  // f32 for every storage type: CUDA has no f64 path (kernels/context.h).
  check_shape(op, "lse", lse, {d.B, d.H, d.T});
  check_dtype(op, "lse", lse, DType::F32);
  check_on_device(op, {{"lse", &lse}});
  if (d.B == 0 || d.T == 0) return;
  const float scale_log2 = float(kLog2e / std::sqrt(double(d.D)));
  const dim3 grid(unsigned((d.T + kTile - 1) / kTile), unsigned(d.B * d.H));
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    dispatch_head_dim(d.D, [&](auto dim) {
      constexpr int DMAX = decltype(dim)::value;
      constexpr size_t smem = forward_smem_bytes<DMAX>();
      allow_smem(flash_forward_kernel<S, DMAX>, smem);
      flash_forward_kernel<S, DMAX><<<grid, kThreads, smem, stream(ctx)>>>(
          tensor_ptr<S>(out), tensor_ptr<float>(lse), tensor_ptr<S>(qkv), d.T, int(d.W), int(d.H), int(d.KV),
          int(d.D), scale_log2);
      XR_CUDA_LAUNCH_CHECK();
    });
  });
}

void flash_attention_backward_fp32(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                                   const Tensor& out, const Tensor& lse, int n_head, int n_kv_head) {
  const char* op = "flash_attention_backward";
  require_cuda(ctx, op);
  const Dims d = check_dims(op, qkv, n_head, n_kv_head);
  attention_checks::check_backward_operands(op, d, dqkv, dout, qkv, out, lse);
  check_dtype(op, "lse", lse, DType::F32);
  check_on_device(op, {{"dqkv", &dqkv}, {"dout", &dout}, {"out", &out}, {"lse", &lse}});
  if (d.B == 0 || d.T == 0) return;
  const int64_t rows = d.B * d.T * d.H;
  float* rowdot = static_cast<float*>(scratch(ctx, size_t(rows) * sizeof(float), op));
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const float scale_log2 = float(kLog2e / std::sqrt(double(d.D)));
  const unsigned n_tiles = unsigned((d.T + kTile - 1) / kTile);
  const dim3 grid(n_tiles, unsigned(d.B * d.H)), grid_kv(n_tiles, unsigned(d.B * d.KV));
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    flash_backward_rowdot_kernel<S><<<blocks_for(rows, kThreads / 32), kThreads, 0, stream(ctx)>>>(
        rowdot, tensor_ptr<S>(dout), tensor_ptr<S>(out), rows, d.T, int(d.H), int(d.D));
    XR_CUDA_LAUNCH_CHECK();
    dispatch_head_dim(d.D, [&](auto dim) {
      constexpr int DMAX = decltype(dim)::value;
      constexpr size_t smem_kv = dkdv_smem_bytes<DMAX>();
      allow_smem(flash_backward_dkdv_kernel<S, DMAX>, smem_kv);
      flash_backward_dkdv_kernel<S, DMAX><<<grid_kv, kThreads, smem_kv, stream(ctx)>>>(
          tensor_ptr<S>(dqkv), tensor_ptr<S>(qkv), tensor_ptr<S>(dout), tensor_ptr<float>(lse), rowdot, d.T,
          int(d.W), int(d.H), int(d.KV), int(d.D), scale, scale_log2);
      XR_CUDA_LAUNCH_CHECK();
      constexpr size_t smem_q = dq_smem_bytes<DMAX>();
      allow_smem(flash_backward_dq_kernel<S, DMAX>, smem_q);
      flash_backward_dq_kernel<S, DMAX><<<grid, kThreads, smem_q, stream(ctx)>>>(
          tensor_ptr<S>(dqkv), tensor_ptr<S>(qkv), tensor_ptr<S>(dout), tensor_ptr<float>(lse), rowdot, d.T,
          int(d.W), int(d.H), int(d.KV), int(d.D), scale, scale_log2);
      XR_CUDA_LAUNCH_CHECK();
    });
  });
}

// The path rule lives in flash_attention_path (kernels/attention.h), which
// the trainer also prints; the chosen launcher runs every check itself.
void flash_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                             int n_kv_head) {
  const Dims d = attention_checks::check_dims("flash_attention_forward", qkv, n_head, n_kv_head);
  if (flash_attention_path(Device::CUDA, qkv.dtype(), d.D) == AttentionPath::TensorCores)
    flash_attention_forward_tc(ctx, out, lse, qkv, n_head, n_kv_head);
  else
    flash_attention_forward_fp32(ctx, out, lse, qkv, n_head, n_kv_head);
}

void flash_attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, int n_head, int n_kv_head) {
  const Dims d = attention_checks::check_dims("flash_attention_backward", qkv, n_head, n_kv_head);
  if (flash_attention_path(Device::CUDA, qkv.dtype(), d.D) == AttentionPath::TensorCores)
    flash_attention_backward_tc(ctx, dqkv, dout, qkv, out, lse, n_head, n_kv_head);
  else
    flash_attention_backward_fp32(ctx, dqkv, dout, qkv, out, lse, n_head, n_kv_head);
}

}  // namespace xirang::cuda
