// CUDA causal flash attention on tensor cores: BF16 and F16 storage, head
// dim D in {32, 64, 96, 128} (flash_attention_path in kernels/attention.h
// names the rule; other cases run the fp32 kernels of attention.cu). Same
// layout, GQA rule, lse and delta conventions as attention.cu.
//
// Products go through WMMA 16x16x16 fragments with 16-bit inputs and float
// accumulators. S = Q K^T and dP = dO V^T read the stored 16-bit inputs, so
// they are exact products summed in float, as in the fp32 kernels; what
// changes is that P (forward, dV) and dS (dK, dQ) are rounded to S before
// their products: a relative error of at most u_S per term. Softmax
// statistics (m, l, lse) and delta stay float and come from unrounded P.
//
// Tiles: 64 query rows x 64 key rows, 128 threads = 4 warps, warp w owning
// the tile's rows 16 w .. 16 w + 15 of every per-row quantity (scores, P,
// dS, O, and in the dK/dV kernel the key rows). A warp therefore only reads
// back what it wrote itself, which needs __syncwarp; the shared K, V, Q, dO
// tiles that all warps read are loaded between two __syncthreads.
//
// Score tiles go through shared memory (float, row stride 68) because
// WMMA's accumulator layout is opaque: after store_matrix_sync the warp
// handles row 16 w + lane / 2, columns 32 (lane % 2) .. + 31, applies the
// causal mask and the softmax in float, and writes P (or dS) as 16-bit
// (row stride 72) for load_matrix_sync as a matrix_a fragment. The forward
// keeps O in shared memory (float) because each key tile rescales its rows
// by alpha; the backward's accumulators (dK, dV or dQ) never rescale and
// stay in fragments for the whole kernel.
//
// Alignment (WMMA wants 256-bit aligned pointers, ldm a multiple of 8 for
// 16-bit and of 4 for float): 16-bit tiles have stride D + 8, so a 16-row
// block starts at 32 (D + 8) bytes and a 16-column step is 32 bytes; float
// tiles have stride 68 or D + 4, multiples of 4. Every region starts at a
// multiple of 128 bytes. qkv rows are W = (H + 2 KV) D elements, so global
// tiles are staged through shared memory, 16 bytes at a time when the base
// pointers are 16-byte aligned, else element by element.
//
// Backward is deterministic (no atomics): one block per (64 key rows, b,
// key/value head) accumulates dK and dV over the group's query heads and
// the query tiles at or below the diagonal; one block per (64 query rows,
// b, h) accumulates dQ over the key tiles up to the diagonal.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/attention_checks.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace xirang::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 128;     // 4 warps
constexpr int kTile = 64;         // query rows and key rows per tile
constexpr int kLdS = kTile + 4;   // float score tile stride
constexpr int kLdP = kTile + 8;   // 16-bit P / dS tile stride
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <class S>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major>;
template <class S>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::row_major>;
template <class S>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

__host__ __device__ constexpr size_t round128(size_t bytes) { return (bytes + 127) / 128 * 128; }

// Bytes of one (64, D + 8) 16-bit tile, a (64, kLdS) float tile, a (64,
// kLdP) 16-bit tile, and a (64, D + 4) float tile.
template <int D>
__host__ __device__ constexpr size_t in_tile_bytes() {
  return round128(size_t(kTile) * (D + 8) * 2);
}
__host__ __device__ constexpr size_t score_tile_bytes() { return round128(size_t(kTile) * kLdS * 4); }
__host__ __device__ constexpr size_t p_tile_bytes() { return round128(size_t(kTile) * kLdP * 2); }
template <int D>
__host__ __device__ constexpr size_t acc_tile_bytes() {
  return round128(size_t(kTile) * (D + 4) * 4);
}
__host__ __device__ constexpr size_t stats_bytes() { return round128(2 * kTile * 4); }

template <int D>
constexpr size_t forward_smem_bytes() {  // Q, K, V, S, P, O
  return 3 * in_tile_bytes<D>() + score_tile_bytes() + p_tile_bytes() + acc_tile_bytes<D>();
}
template <int D>
constexpr size_t dkdv_smem_bytes() {  // K, V, Q, dO, S^T, dP^T, P^T, dS^T, lse, delta
  return 4 * in_tile_bytes<D>() + 2 * score_tile_bytes() + 2 * p_tile_bytes() + stats_bytes();
}
template <int D>
constexpr size_t dq_smem_bytes() {  // Q, dO, K, V, S, dP, dS, lse, delta
  return 4 * in_tile_bytes<D>() + 2 * score_tile_bytes() + p_tile_bytes() + stats_bytes();
}
// The backward kernels stage their (64, D + 4) float results in the two
// adjacent score tiles once the main loop is done.
static_assert(acc_tile_bytes<128>() <= 2 * score_tile_bytes(), "result staging must fit in the score tiles");
static_assert(forward_smem_bytes<128>() <= 227 * 1024 && dkdv_smem_bytes<128>() <= 227 * 1024 &&
                  dq_smem_bytes<128>() <= 227 * 1024,
              "sm_90 allows 227 KiB of shared memory per block");

// dst (64, D + 8) <- rows [row0, row0 + 64) of a D-wide head slice at src,
// rows `stride` elements apart; rows at or past T are zero. D % 8 == 0.
template <int D, class S>
__device__ __forceinline__ void load_tile(S* dst, const S* __restrict__ src, int64_t stride, int64_t row0, int64_t T,
                                          bool vec) {
  constexpr int LD = D + 8, CH = D / 8;  // 8-element (16-byte) chunks per row
  for (int idx = threadIdx.x; idx < kTile * CH; idx += kThreads) {
    const int r = idx / CH, c = (idx % CH) * 8;
    const int64_t t = row0 + r;
    S* d = dst + r * LD + c;
    if (t >= T) {
      *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    } else if (vec) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(src + t * stride + c);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] = src[t * stride + c + e];
    }
  }
}

// lse (in log2 units) and delta of query rows [q0, q0 + 64) of head bh; zero past T.
__device__ __forceinline__ void load_row_stats(float* lse_s, float* delta_s, const float* __restrict__ lse,
                                               const float* __restrict__ delta, int64_t bh, int64_t q0, int64_t T) {
  for (int r = threadIdx.x; r < kTile; r += kThreads) {
    const int64_t t = q0 + r;
    lse_s[r] = t < T ? lse[bh * T + t] * kLog2e : 0.f;
    delta_s[r] = t < T ? delta[bh * T + t] : 0.f;
  }
}

// out_s[16 rows of this warp, 64 columns] = A (16 x D, rows a, stride LD) .
// B^T, B's 64 rows at b (stride LD): a warp's 16 x 64 block of A B^T.
template <int D, class S>
__device__ __forceinline__ void warp_abt(float* out_s, const S* a, const S* b) {
  constexpr int LD = D + 8;
#pragma unroll
  for (int n = 0; n < kTile / 16; ++n) {
    FragAcc acc;
    wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      FragA<S> fa;
      FragBCol<S> fb;  // (B^T)[k][n] = B[n][k]: B row-major read as column-major
      wmma::load_matrix_sync(fa, a + k * 16, LD);
      wmma::load_matrix_sync(fb, b + (n * 16) * LD + k * 16, LD);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out_s + n * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// acc[n] += P (16 x 64 at p, stride kLdP) . X (64 x D at x, stride D + 8), column block n.
template <int D, class S>
__device__ __forceinline__ void warp_px(FragAcc (&acc)[D / 16], const S* p, const S* x) {
  constexpr int LD = D + 8;
#pragma unroll
  for (int k = 0; k < kTile / 16; ++k) {
    FragA<S> fa;
    wmma::load_matrix_sync(fa, p + k * 16, kLdP);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragBRow<S> fb;
      wmma::load_matrix_sync(fb, x + (k * 16) * LD + n * 16, LD);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// grid (query tiles, B * H), last query tiles first (they visit the most key tiles).
template <class S, int D>
__global__ void __launch_bounds__(kThreads)
    tc_forward_kernel(S* __restrict__ out, float* __restrict__ lse, const S* __restrict__ qkv, int64_t T, int W,
                      int H, int KV, float scale_log2, bool vec) {
  constexpr int LD = D + 8, LDO = D + 4, NF = D / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  S* Qs = reinterpret_cast<S*>(smem);                                     // (64, LD)
  S* Ks = reinterpret_cast<S*>(smem + in_tile_bytes<D>());                // (64, LD)
  S* Vs = reinterpret_cast<S*>(smem + 2 * in_tile_bytes<D>());            // (64, LD)
  float* Ss = reinterpret_cast<float*>(smem + 3 * in_tile_bytes<D>());    // (64, kLdS): scaled scores
  S* Ps = reinterpret_cast<S*>(smem + 3 * in_tile_bytes<D>() + score_tile_bytes());  // (64, kLdP)
  float* Os = reinterpret_cast<float*>(smem + 3 * in_tile_bytes<D>() + score_tile_bytes() + p_tile_bytes());  // (64, LDO)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp * 16;                                // this warp's first tile row
  const int row = wr + lane / 2, c0 = (lane % 2) * 32;     // softmax: one row, 32 columns
  const int qt = int(gridDim.x) - 1 - int(blockIdx.x);
  const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / KV);
  const int64_t q0 = int64_t(qt) * kTile, C = int64_t(H) * D;
  const S* row0 = qkv + int64_t(b) * T * W;
  const S* kbase = row0 + C + int64_t(g) * D;
  const S* vbase = kbase + int64_t(KV) * D;
  load_tile<D>(Qs, row0 + int64_t(h) * D, W, q0, T, vec);
  for (int i = threadIdx.x; i < kTile * LDO; i += kThreads) Os[i] = 0.f;

  const int64_t qi = q0 + row;
  float m = -CUDART_INF_F, l = 0.f;  // running max (log2 units) and sum of this lane's row
  for (int kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = int64_t(kt) * kTile;
    __syncthreads();  // every warp is done with the previous K, V (and Q, O are written)
    load_tile<D>(Ks, kbase, W, k0, T, vec);
    load_tile<D>(Vs, vbase, W, k0, T, vec);
    __syncthreads();
    warp_abt<D>(Ss + wr * kLdS, Qs + wr * LD, Ks);
    __syncwarp();
    // Causal mask and online softmax. Key 0 is unmasked for every row on
    // the first tile, so m is finite from then on; rows at or past T are
    // computed (finite: their Q and K rows are zero) but never written.
    float* srow = Ss + row * kLdS + c0;
    float mx = -CUDART_INF_F;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const float s = (k0 + c0 + c <= qi) ? srow[c] * scale_log2 : -CUDART_INF_F;
      srow[c] = s;
      mx = fmaxf(mx, s);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float ref = m_new == -CUDART_INF_F ? 0.f : m_new;
    const float alpha = exp2f(m - ref);  // 0 on the first tile
    float sum = 0.f;
    S* prow = Ps + row * kLdP + c0;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const float p = exp2f(srow[c] - ref);
      sum += p;
      prow[c] = store<S>(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    float* orow = Os + row * LDO + (lane % 2) * (D / 2);
#pragma unroll 8
    for (int c = 0; c < D / 2; ++c) orow[c] *= alpha;
    __syncwarp();
    // O += P V for this warp's 16 rows.
    FragAcc acc[NF];
#pragma unroll
    for (int n = 0; n < NF; ++n) wmma::load_matrix_sync(acc[n], Os + wr * LDO + n * 16, LDO, wmma::mem_row_major);
    warp_px<D>(acc, Ps + wr * kLdP, Vs);
#pragma unroll
    for (int n = 0; n < NF; ++n) wmma::store_matrix_sync(Os + wr * LDO + n * 16, acc[n], LDO, wmma::mem_row_major);
    __syncwarp();
  }

  if (qi < T) {
    const float inv = 1.f / l;
    const float* orow = Os + row * LDO + (lane % 2) * (D / 2);
    S* dst = out + (int64_t(b) * T + qi) * C + int64_t(h) * D + (lane % 2) * (D / 2);
    for (int c = 0; c < D / 2; ++c) dst[c] = store<S>(orow[c] * inv);
    if (lane % 2 == 0) lse[int64_t(bh) * T + qi] = (m + log2f(l)) * kLn2;
  }
}

// delta[b, h, t] = dout[b, t, h, :] . out[b, t, h, :] in float; one warp per
// (b, t, h), in memory order of out, whose row r = (b T + t) H + h starts at r D.
template <class S>
__global__ void __launch_bounds__(256)
    tc_delta_kernel(float* __restrict__ delta, const S* __restrict__ dout, const S* __restrict__ out, int64_t rows,
                    int64_t T, int H, int D) {
  const int64_t r = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (r >= rows) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  for (int d = lane; d < D; d += 32) s += load(dout[r * D + d]) * load(out[r * D + d]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) {
    const int64_t bt = r / H, b = bt / T, t = bt % T;
    delta[(b * H + r % H) * T + t] = s;
  }
}

// Writes a (64, D) float tile (stride D + 4) times `mul` to rows [row0, row0
// + 64) of a D-wide slice at dst (rows `stride` apart), rows below T only.
template <int D, class S>
__device__ __forceinline__ void write_tile(S* __restrict__ dst, const float* tile, int64_t stride, int64_t row0,
                                           int64_t T, float mul) {
  for (int idx = threadIdx.x; idx < kTile * D; idx += kThreads) {
    const int r = idx / D, c = idx % D;
    if (row0 + r < T) dst[(row0 + r) * stride + c] = store<S>(tile[r * (D + 4) + c] * mul);
  }
}

// Stores a warp's 16 x D accumulators into rows 16 w .. of a (64, D + 4) float tile.
template <int D>
__device__ __forceinline__ void stage_acc(float* tile, FragAcc (&acc)[D / 16], int wr) {
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::store_matrix_sync(tile + wr * (D + 4) + n * 16, acc[n], D + 4, wmma::mem_row_major);
}

// grid (key tiles, B * KV): dK and dV of 64 key rows of one key/value head,
// summed over the query heads of its group. Tiles are transposed (rows =
// keys): S^T = K Q^T, dP^T = V dO^T, then dV += P^T dO, dK += dS^T Q.
template <class S, int D>
__global__ void __launch_bounds__(kThreads)
    tc_dkdv_kernel(S* __restrict__ dqkv, const S* __restrict__ qkv, const S* __restrict__ dout,
                   const float* __restrict__ lse, const float* __restrict__ delta, int64_t T, int W, int H, int KV,
                   float scale, float scale_log2, bool vec) {
  constexpr int LD = D + 8, NF = D / 16;
  constexpr size_t IN = in_tile_bytes<D>(), SC = score_tile_bytes(), PT = p_tile_bytes();
  extern __shared__ __align__(128) unsigned char smem[];
  S* Ks = reinterpret_cast<S*>(smem);                                   // (64, LD)
  S* Vs = reinterpret_cast<S*>(smem + IN);                              // (64, LD)
  S* Qs = reinterpret_cast<S*>(smem + 2 * IN);                          // (64, LD)
  S* Gs = reinterpret_cast<S*>(smem + 3 * IN);                          // (64, LD): dO
  float* St = reinterpret_cast<float*>(smem + 4 * IN);                  // (64, kLdS): keys x queries
  float* dPt = reinterpret_cast<float*>(smem + 4 * IN + SC);            // (64, kLdS)
  S* Pt = reinterpret_cast<S*>(smem + 4 * IN + 2 * SC);                 // (64, kLdP)
  S* dSt = reinterpret_cast<S*>(smem + 4 * IN + 2 * SC + PT);           // (64, kLdP)
  float* lse_s = reinterpret_cast<float*>(smem + 4 * IN + 2 * SC + 2 * PT);  // (64)
  float* delta_s = lse_s + kTile;                                            // (64)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp * 16, row = wr + lane / 2, c0 = (lane % 2) * 32;
  const int kt = blockIdx.x;
  const int bg = blockIdx.y, b = bg / KV, g = bg % KV, G = H / KV;
  const int64_t k0 = int64_t(kt) * kTile, C = int64_t(H) * D;
  const S* row0 = qkv + int64_t(b) * T * W;
  const int64_t k_off = C + int64_t(g) * D, v_off = k_off + int64_t(KV) * D;  // in a qkv row
  load_tile<D>(Ks, row0 + k_off, W, k0, T, vec);
  load_tile<D>(Vs, row0 + v_off, W, k0, T, vec);

  FragAcc dk[NF], dv[NF];
#pragma unroll
  for (int n = 0; n < NF; ++n) {
    wmma::fill_fragment(dk[n], 0.f);
    wmma::fill_fragment(dv[n], 0.f);
  }
  const int64_t kj = k0 + row;  // this lane's key in the elementwise step
  for (int h = g * G; h < (g + 1) * G; ++h) {
    const int64_t bh = int64_t(b) * H + h;
    for (int qt = kt; qt < int(gridDim.x); ++qt) {
      const int64_t q0 = int64_t(qt) * kTile;
      __syncthreads();  // every warp is done with the previous Q, dO, lse, delta
      load_tile<D>(Qs, row0 + int64_t(h) * D, W, q0, T, vec);
      load_tile<D>(Gs, dout + int64_t(b) * T * C + int64_t(h) * D, C, q0, T, vec);
      load_row_stats(lse_s, delta_s, lse, delta, bh, q0, T);
      __syncthreads();
      warp_abt<D>(St + wr * kLdS, Ks + wr * LD, Qs);
      warp_abt<D>(dPt + wr * kLdS, Vs + wr * LD, Gs);
      __syncwarp();
      // P^T and dS^T for key kj (this lane's row), queries q0 + c0 + c.
      const float* srow = St + row * kLdS + c0;
      const float* dprow = dPt + row * kLdS + c0;
      S* prow = Pt + row * kLdP + c0;
      S* dsrow = dSt + row * kLdP + c0;
#pragma unroll 8
      for (int c = 0; c < 32; ++c) {
        const int64_t qi = q0 + c0 + c;
        const float p = (qi < T && kj <= qi) ? exp2f(srow[c] * scale_log2 - lse_s[c0 + c]) : 0.f;
        prow[c] = store<S>(p);
        dsrow[c] = store<S>(p * (dprow[c] - delta_s[c0 + c]));
      }
      __syncwarp();
      warp_px<D>(dv, Pt + wr * kLdP, Gs);
      warp_px<D>(dk, dSt + wr * kLdP, Qs);
    }
  }

  // Stage through the score tiles (all warps may still read them until this barrier).
  float* stage = St;
  __syncthreads();
  stage_acc<D>(stage, dk, wr);
  __syncthreads();
  write_tile<D>(dqkv + int64_t(b) * T * W + k_off, stage, W, k0, T, scale);
  __syncthreads();
  stage_acc<D>(stage, dv, wr);
  __syncthreads();
  write_tile<D>(dqkv + int64_t(b) * T * W + v_off, stage, W, k0, T, 1.f);
}

// grid (query tiles, B * H), last tiles first: dQ of 64 query rows of one
// head, dQ += dS K over key tiles 0 .. qt.
template <class S, int D>
__global__ void __launch_bounds__(kThreads)
    tc_dq_kernel(S* __restrict__ dqkv, const S* __restrict__ qkv, const S* __restrict__ dout,
                 const float* __restrict__ lse, const float* __restrict__ delta, int64_t T, int W, int H, int KV,
                 float scale, float scale_log2, bool vec) {
  constexpr int LD = D + 8, NF = D / 16;
  constexpr size_t IN = in_tile_bytes<D>(), SC = score_tile_bytes(), PT = p_tile_bytes();
  extern __shared__ __align__(128) unsigned char smem[];
  S* Qs = reinterpret_cast<S*>(smem);                              // (64, LD)
  S* Gs = reinterpret_cast<S*>(smem + IN);                         // (64, LD): dO
  S* Ks = reinterpret_cast<S*>(smem + 2 * IN);                     // (64, LD)
  S* Vs = reinterpret_cast<S*>(smem + 3 * IN);                     // (64, LD)
  float* Ss = reinterpret_cast<float*>(smem + 4 * IN);             // (64, kLdS): queries x keys
  float* dPs = reinterpret_cast<float*>(smem + 4 * IN + SC);       // (64, kLdS)
  S* dSs = reinterpret_cast<S*>(smem + 4 * IN + 2 * SC);           // (64, kLdP)
  float* lse_s = reinterpret_cast<float*>(smem + 4 * IN + 2 * SC + PT);  // (64)
  float* delta_s = lse_s + kTile;                                        // (64)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp * 16, row = wr + lane / 2, c0 = (lane % 2) * 32;
  const int qt = int(gridDim.x) - 1 - int(blockIdx.x);
  const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / KV);
  const int64_t q0 = int64_t(qt) * kTile, C = int64_t(H) * D;
  const S* row0 = qkv + int64_t(b) * T * W;
  const S* kbase = row0 + C + int64_t(g) * D;
  const S* vbase = kbase + int64_t(KV) * D;
  load_tile<D>(Qs, row0 + int64_t(h) * D, W, q0, T, vec);
  load_tile<D>(Gs, dout + int64_t(b) * T * C + int64_t(h) * D, C, q0, T, vec);
  load_row_stats(lse_s, delta_s, lse, delta, bh, q0, T);

  FragAcc dq[NF];
#pragma unroll
  for (int n = 0; n < NF; ++n) wmma::fill_fragment(dq[n], 0.f);
  const int64_t qi = q0 + row;  // this lane's query in the elementwise step
  for (int kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = int64_t(kt) * kTile;
    __syncthreads();  // every warp is done with the previous K, V (and Q, dO, stats are written)
    load_tile<D>(Ks, kbase, W, k0, T, vec);
    load_tile<D>(Vs, vbase, W, k0, T, vec);
    __syncthreads();
    warp_abt<D>(Ss + wr * kLdS, Qs + wr * LD, Ks);
    warp_abt<D>(dPs + wr * kLdS, Gs + wr * LD, Vs);
    __syncwarp();
    const float* srow = Ss + row * kLdS + c0;
    const float* dprow = dPs + row * kLdS + c0;
    S* dsrow = dSs + row * kLdP + c0;
    const float lse_r = lse_s[row], delta_r = delta_s[row];
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const float p = (qi < T && k0 + c0 + c <= qi) ? exp2f(srow[c] * scale_log2 - lse_r) : 0.f;
      dsrow[c] = store<S>(p * (dprow[c] - delta_r));
    }
    __syncwarp();
    warp_px<D>(dq, dSs + wr * kLdP, Ks);
  }

  float* stage = Ss;
  __syncthreads();
  stage_acc<D>(stage, dq, wr);
  __syncthreads();
  write_tile<D>(dqkv + int64_t(b) * T * W + int64_t(h) * D, stage, W, q0, T, scale);
}

using attention_checks::Dims;

Dims check_dims(const char* op, const Tensor& qkv, int n_head, int n_kv_head) {
  const Dims d = attention_checks::check_dims(op, qkv, n_head, n_kv_head);
  if (flash_attention_path(Device::CUDA, qkv.dtype(), d.D) != AttentionPath::TensorCores)
    fail(ErrorKind::Shape, op, ": the tensor-core path takes bf16 or f16 with head dim 32, 64, 96 or 128, got ",
         dtype_name(qkv.dtype()), " with head dim ", d.D);
  if (d.B * d.H > 65535) fail(ErrorKind::Shape, op, ": B * n_head = ", d.B * d.H, " exceeds 65535 (grid y)");
  if (d.W > 0x7fffffff) fail(ErrorKind::Shape, op, ": qkv width ", d.W, " is too large");
  check_on_device(op, {{"qkv", &qkv}});
  return d;
}

template <class F>
void dispatch_tc(DType t, int64_t D, F&& f) {
  auto by_dim = [&](auto tag) {
    switch (D) {
      case 32: f(tag, std::integral_constant<int, 32>{}); break;
      case 64: f(tag, std::integral_constant<int, 64>{}); break;
      case 96: f(tag, std::integral_constant<int, 96>{}); break;
      default: f(tag, std::integral_constant<int, 128>{}); break;  // check_dims allowed only 128 here
    }
  };
  if (t == DType::BF16)
    by_dim(__nv_bfloat16{});
  else
    by_dim(__half{});
}

template <class K>
void allow_smem(K* kernel, size_t bytes) {
  XR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <class S>
S* tensor_ptr(const Tensor& t) {  // callers have checked t's dtype against S
  return static_cast<S*>(t.raw());
}

}  // namespace

void flash_attention_forward_tc(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                                int n_kv_head) {
  const char* op = "flash_attention_forward";
  require_cuda(ctx, op);
  const Dims d = check_dims(op, qkv, n_head, n_kv_head);
  check_shape(op, "out", out, {d.B, d.T, d.C});
  check_dtype(op, "out", out, qkv.dtype());
  check_on_device(op, {{"out", &out}});
  check_shape(op, "lse", lse, {d.B, d.H, d.T});
  check_dtype(op, "lse", lse, DType::F32);
  check_on_device(op, {{"lse", &lse}});
  if (d.B == 0 || d.T == 0) return;
  const float scale_log2 = float(kLog2e / std::sqrt(double(d.D)));
  const dim3 grid(unsigned((d.T + kTile - 1) / kTile), unsigned(d.B * d.H));
  const bool vec = aligned16(qkv.raw());
  dispatch_tc(qkv.dtype(), d.D, [&](auto tag, auto dim) {
    using S = decltype(tag);
    constexpr int D = decltype(dim)::value;
    constexpr size_t smem = forward_smem_bytes<D>();
    allow_smem(tc_forward_kernel<S, D>, smem);
    tc_forward_kernel<S, D><<<grid, kThreads, smem, stream(ctx)>>>(tensor_ptr<S>(out), tensor_ptr<float>(lse),
                                                                    tensor_ptr<S>(qkv), d.T, int(d.W), int(d.H),
                                                                    int(d.KV), scale_log2, vec);
    XR_CUDA_LAUNCH_CHECK();
  });
}

void flash_attention_backward_tc(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                                 const Tensor& out, const Tensor& lse, int n_head, int n_kv_head) {
  const char* op = "flash_attention_backward";
  require_cuda(ctx, op);
  const Dims d = check_dims(op, qkv, n_head, n_kv_head);
  attention_checks::check_backward_operands(op, d, dqkv, dout, qkv, out, lse);
  check_dtype(op, "lse", lse, DType::F32);
  check_on_device(op, {{"dqkv", &dqkv}, {"dout", &dout}, {"out", &out}, {"lse", &lse}});
  if (d.B == 0 || d.T == 0) return;
  const int64_t rows = d.B * d.T * d.H;
  float* delta = static_cast<float*>(scratch(ctx, size_t(rows) * sizeof(float), op));
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  const float scale_log2 = float(kLog2e / std::sqrt(double(d.D)));
  const unsigned n_tiles = unsigned((d.T + kTile - 1) / kTile);
  const dim3 grid(n_tiles, unsigned(d.B * d.H)), grid_kv(n_tiles, unsigned(d.B * d.KV));
  const bool vec = aligned16(qkv.raw()) && aligned16(dout.raw());
  dispatch_tc(qkv.dtype(), d.D, [&](auto tag, auto dim) {
    using S = decltype(tag);
    constexpr int D = decltype(dim)::value;
    tc_delta_kernel<S><<<blocks_for(rows, 8), 256, 0, stream(ctx)>>>(delta, tensor_ptr<S>(dout), tensor_ptr<S>(out),
                                                                      rows, d.T, int(d.H), D);
    XR_CUDA_LAUNCH_CHECK();
    constexpr size_t smem_kv = dkdv_smem_bytes<D>();
    allow_smem(tc_dkdv_kernel<S, D>, smem_kv);
    tc_dkdv_kernel<S, D><<<grid_kv, kThreads, smem_kv, stream(ctx)>>>(
        tensor_ptr<S>(dqkv), tensor_ptr<S>(qkv), tensor_ptr<S>(dout), tensor_ptr<float>(lse), delta, d.T, int(d.W),
        int(d.H), int(d.KV), scale, scale_log2, vec);
    XR_CUDA_LAUNCH_CHECK();
    constexpr size_t smem_q = dq_smem_bytes<D>();
    allow_smem(tc_dq_kernel<S, D>, smem_q);
    tc_dq_kernel<S, D><<<grid, kThreads, smem_q, stream(ctx)>>>(tensor_ptr<S>(dqkv), tensor_ptr<S>(qkv),
                                                                 tensor_ptr<S>(dout), tensor_ptr<float>(lse), delta,
                                                                 d.T, int(d.W), int(d.H), int(d.KV), scale,
                                                                 scale_log2, vec);
    XR_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace xirang::cuda
