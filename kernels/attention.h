// kernels/attention.h: causal multi-head self-attention.
//
// qkv (B, T, 3C) holds, per token, all heads' queries, then keys, then values:
// [q_0 .. q_{H-1} | k_0 .. k_{H-1} | v_0 .. v_{H-1}], each head D = C / H wide.
// Forward saves the softmax probabilities (B, H, T, T) for backward (entries
// above the diagonal are zero).
//
// qkv, out, dout and dqkv share one of F32, F64, BF16, F16; 16-bit inputs are
// widened to float per (batch, head) and each output is rounded once.
// probs has qkv's dtype or, beside 16-bit qkv, F32 (which keeps the
// probabilities the backward reads at float precision). The F32 and F64
// probability-based pair sums its softmax rows in its own type, not double
// (the golden losses pin those results); all other paths sum in double.
//
//   attention_forward(ctx, out, probs, qkv, n_head);      // out (B, T, C)
//   attention_backward(ctx, dqkv, dout, qkv, probs, n_head);
//   flash_attention_forward(ctx, out, lse, qkv, n_head);  // lse (B, H, T)
//   flash_attention_backward(ctx, dqkv, dout, qkv, out, lse, n_head);
#pragma once

#include "kernels/context.h"

namespace xirang {

void attention_forward(const KernelContext& ctx, Tensor out, Tensor probs, const Tensor& qkv, int n_head);
// dqkv (B, T, 3C) is overwritten.
void attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                        const Tensor& probs, int n_head);

// Flash-style attention: forward saves only lse (B, H, T), the log-sum-exp
// of each query row's scaled causal scores (F32 when qkv is 16-bit, else
// qkv's dtype); backward recomputes the probabilities from q, k and lse, so
// memory grows with T, not T^2. Scores are scaled by 1/sqrt(D). Backward
// takes delta_t = dout_t . out_t from the stored out (so with 16-bit storage
// it reads out as rounded). On the CPU, one task per (batch, head), each
// holding O(T D) of scratch; softmax sums and delta accumulate in double.
void flash_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head);
// dqkv (B, T, 3C) is overwritten; out is the forward's output.
void flash_attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, int n_head);

}  // namespace xirang
