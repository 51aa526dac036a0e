// kernels/attention.h: causal multi-head self-attention, and (flash pair
// only) grouped-query attention.
//
// qkv (B, T, 3C) holds, per token, all heads' queries, then keys, then values:
// [q_0 .. q_{H-1} | k_0 .. k_{H-1} | v_0 .. v_{H-1}], each head D = C / H wide.
// The probability-based pair saves the softmax probabilities (B, H, T, T) for
// backward (entries above the diagonal are zero).
//
// Grouped-query attention (flash pair): H query heads share KV = n_kv_head
// key/value heads (KV divides H; KV = H is multi-head, KV = 1 multi-query).
// qkv is then (B, T, (H + 2 KV) D), [q_0 .. q_{H-1} | k_0 .. k_{KV-1} |
// v_0 .. v_{KV-1}], and query head h attends with key/value head h / (H / KV);
// out and dout stay (B, T, C = H D) and lse (B, H, T). In dqkv, the dk and dv
// of a key/value head are the sums over the H / KV query heads that share it.
// A tensor-parallel rank passes its own H / tp and KV / tp in the same layout.
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
//   flash_attention_forward(ctx, out, lse, qkv, 8, 2);    // GQA: qkv (B, T, 12 D)
#pragma once

#include <cstdint>
#include <string>

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
// it reads out as rounded). On the CPU, one task per (batch, head) forward
// and per (batch, key/value head) backward (B KV tasks: multi-query attention
// with a small batch leaves cores idle), each holding O(T D) of scratch;
// softmax sums, delta and the dk, dv sums over a group's query heads
// accumulate in double (on CUDA in float). n_kv_head 0 (the default) means
// n_head: multi-head attention, bit for bit as without the argument.
void flash_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                             int n_kv_head = 0);
// dqkv (qkv's shape) is overwritten; out is the forward's output.
void flash_attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, int n_head, int n_kv_head = 0);

// Which implementation runs the flash pair for a device, storage dtype and
// head dim: on CUDA, tensor cores for bf16 and f16 with head dim 32, 64, 96
// or 128 (P and dS rounded to the storage type before their products,
// softmax statistics and accumulation in float), else the fp32 CUDA-core
// kernels; on the CPU, the CPU op. The CUDA entry points dispatch by this
// rule, and the trainer prints its name, e.g.
//   flash_attention_path_name(Device::CUDA, DType::BF16, 64)
//     == "tensor cores (bf16, head dim 64)"
enum class AttentionPath { Cpu, CudaCores, TensorCores };
AttentionPath flash_attention_path(Device device, DType dtype, int64_t head_dim);
std::string flash_attention_path_name(Device device, DType dtype, int64_t head_dim);

}  // namespace xirang
