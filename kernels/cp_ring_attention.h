// kernels/cp_ring_attention.h: the ring variant of context-parallel causal
// attention (Ring Attention; Megatron-Core's p2p): a rank's queries meet the
// sequence's keys and values one cp rank's block at a time, while the next
// block travels (models/layers/cp_comm.h drives the ring), and the partial
// results are merged with their log-sum-exps.
//
// Blocks and masks (kernels/context_split.h's layout: T = 2 c L, rank r
// holds chunks r and 2c-1-r, lower first; its qkv (B, 2L, (H + 2 KV) D)).
// At ring step s rank r holds kv (B, 2L, 2 KV D), the packed keys and
// values of rank src = (r - s) mod c (kv_pack's layout). Its local order is
// position order, so the keys of src that a query at position p may see
// are a prefix: the first cp_ring_keys_seen(split, src, p) rows. Per pair
// of chunks (query chunk of r, key chunk of src) that is: lower key chunk,
// full; the same chunk, the causal diagonal; higher, nothing (skipped: a
// query block of one chunk whose prefix is empty is not computed). Under
// head-tail, with i = r, j = src:
//
//                     key chunk j (head)     key chunk 2c-1-j (tail)
//   query head i      full j<i, diag j=i     skipped (2c-1-j >= c > i)
//   query tail 2c-1-i full (j <= c-1)        full j>i, diag j=i
//
// so every step does two chunks' worth of pairs (L^2 each; the own step s =
// 0 two diagonals and one full) on every rank: the ring keeps the balance.
//
// Forward: o_acc (B, 2L, H D) and lse (B, H, 2L) are F32 accumulators (the
// float compute type; F64 storage is refused, the all-gather path keeps
// the float64 reference); each step computes the block's normalized
// partial output and log-sum-exp per query row and merges them in
// (attention_lse_merge's arithmetic, in double). Backward: with the final
// lse, P = e^(scale q.k - lse) is exact per block, so each step adds its dq
// into dq_acc (F32) and writes the block's dk, dv from this rank's queries
// into dkv (B, 2L, 2 KV D), which travels back to src (the layer adds the
// hops' pieces). The sums run in another order than the all-gather's single
// pass over the keys: results agree within float rounding, not bitwise.
//
//   cp_ring_forward_begin(ctx, o_acc, lse);
//   for (s = 0; s < c; ++s) cp_ring_forward_step(ctx, o_acc, lse, qkv, kv_s, split, rank, src_s, H, KV);
//   cp_ring_forward_end(ctx, out, o_acc);
//   cp_ring_backward_begin(ctx, dq_acc);
//   for (s ...) cp_ring_backward_step(ctx, dq_acc, dkv_s, dout, qkv, kv_s, out, lse, split, rank, src_s, H, KV);
//   cp_ring_backward_end(ctx, dqkv, dq_acc, H, KV);       // dqkv's q columns
#pragma once

#include <cstdint>

#include "kernels/context.h"
#include "kernels/context_split.h"

namespace xirang {

// Rows of rank `src`'s block (local order) that a query at global position p sees.
int64_t cp_ring_keys_seen(const ContextSplit& split, int src, int64_t p);

// o_acc (B, T, H D) F32 zero, lse (B, H, T) F32 minus infinity: no keys seen yet.
void cp_ring_forward_begin(const KernelContext& ctx, Tensor o_acc, Tensor lse);
// Rank `rank`'s queries (qkv (B, 2L, (H + 2 KV) D); its k and v columns not
// read) against rank `src`'s keys and values kv (B, 2L, 2 KV D), merged into o_acc and lse.
void cp_ring_forward_step(const KernelContext& ctx, Tensor o_acc, Tensor lse, const Tensor& qkv, const Tensor& kv,
                          const ContextSplit& split, int rank, int src, int n_head, int n_kv_head = 0);
// out (B, T, H D) in qkv's dtype = o_acc.
void cp_ring_forward_end(const KernelContext& ctx, Tensor out, const Tensor& o_acc);

// dq_acc (B, T, H D) F32 zero.
void cp_ring_backward_begin(const KernelContext& ctx, Tensor dq_acc);
// dq_acc += the block's dq; dkv (B, 2L, 2 KV D) overwritten: the gradient of
// src's keys and values from this rank's queries (zero where none sees them).
// out and lse are the forward's final ones.
void cp_ring_backward_step(const KernelContext& ctx, Tensor dq_acc, Tensor dkv, const Tensor& dout,
                           const Tensor& qkv, const Tensor& kv, const Tensor& out, const Tensor& lse,
                           const ContextSplit& split, int rank, int src, int n_head, int n_kv_head = 0);
// dqkv's q columns = dq_acc (its k and v columns untouched).
void cp_ring_backward_end(const KernelContext& ctx, Tensor dqkv, const Tensor& dq_acc, int n_head,
                          int n_kv_head = 0);

// The merge each forward step applies per query row, exposed for its
// float64 test: (o_acc, lse_acc) <- the softmax-weighted union of itself and
// (o_part, lse_part); each a normalized output row (B, T, H D) and its
// log-sum-exp (B, H, T), all F32. lse = log(e^a + e^b) and o = e^(a-lse) o_a
// + e^(b-lse) o_b in double; a side at minus infinity has seen no key.
void attention_lse_merge(const KernelContext& ctx, Tensor o_acc, Tensor lse_acc, const Tensor& o_part,
                         const Tensor& lse_part, int n_head);

}  // namespace xirang
