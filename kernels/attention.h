// kernels/attention.h: causal multi-head self-attention.
//
// qkv (B, T, 3C) holds, per token, all heads' queries, then keys, then values:
// [q_0 .. q_{H-1} | k_0 .. k_{H-1} | v_0 .. v_{H-1}], each head D = C / H wide.
// Forward saves the softmax probabilities (B, H, T, T) for backward (entries
// above the diagonal are zero).
//
//   attention_forward(ctx, out, probs, qkv, n_head);      // out (B, T, C)
//   attention_backward(ctx, dqkv, dout, qkv, probs, n_head);
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
// memory grows with T, not T^2. Scores are scaled by 1/sqrt(D).
void flash_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head);
// dqkv (B, T, 3C) is overwritten; out is the forward's output.
void flash_attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, int n_head);

}  // namespace xirang
