// kernels/decode_attention.h: causal attention of new tokens against a
// key/value cache, for autoregressive generation.
//
// A sequence of B batch rows has `pos` tokens cached already. The n new
// tokens of each row arrive as a packed qkv (B, n, (H + 2 KV) D) in the
// layout of kernels/attention.h ([q_0 .. q_{H-1} | k_0 .. k_{KV-1} | v_0 ..
// v_{KV-1}], query head h reading key/value head h / (H / KV)). The op first
// appends their keys and values to the caches at positions [pos, pos + n),
// then new token i (position pos + i) attends to cache positions
// [0, pos + i]: causal over everything seen so far. Prefill is pos = 0 with
// the whole prompt (n = T: the same result as flash_attention_forward on
// that qkv), decoding is n = 1 with pos growing by one per call.
//
//   Tensor kc = arena.alloc({B, T_max, KV * D}, dt, "k cache"), vc = ...;   // once, per layer
//   decode_attention_forward(ctx, out, kc, vc, qkv_prompt, /*pos=*/0, H, KV);   // out (B, T, H D)
//   decode_attention_forward(ctx, out1, kc, vc, qkv_next, /*pos=*/T, H, KV);    // out1 (B, 1, H D)
//
// Dtypes: qkv, out and the caches share one of F32, F64 (CPU), BF16, F16;
// the cache stores k and v as qkv holds them (no rounding). Scores are scaled
// by 1/sqrt(D); arithmetic in the compute type (kernels/context.h), softmax
// sums in double on the CPU and in float on CUDA; each output rounded once.
// On the CPU one task per (batch, query head) computes all of that head's
// rows, so the result does not depend on the thread count.
#pragma once

#include <cstdint>

#include "kernels/context.h"

namespace xirang {

// out (B, n, H D); k_cache, v_cache (B, T_max, KV D), positions [pos, pos + n)
// overwritten with the new keys and values; needs 0 <= pos and
// pos + n <= T_max (a Shape error otherwise). n_kv_head 0 means n_head.
void decode_attention_forward(const KernelContext& ctx, Tensor out, Tensor k_cache, Tensor v_cache, const Tensor& qkv,
                              int64_t pos, int n_head, int n_kv_head = 0);

}  // namespace xirang
