// kernels/cp_attention.h: causal attention of one context-parallel rank's
// query rows against the keys and values of the whole sequence, gathered
// from the cp group (kernels/context_split.h says which rows a rank holds).
//
// Each rank holds 2L of the sequence's T rows (its two chunks) as a packed
// qkv (B, 2L, (H + 2 KV) D) in kernels/attention.h's layout. The layer packs
// its k and v columns into kv (B, 2L, 2 KV D) = [k_0 .. k_{KV-1} | v_0 ..
// v_{KV-1}] (kv_pack), all-gathers them over the cp group into kv_all
// (c, B, 2L, 2 KV D) (rank r's block r), and runs the attention: local row t,
// at global position p = split.position(rank, t), attends to every key at a
// position <= p, which sits in kv_all[owner][b][split.local_row(p', &owner)].
// Backward writes the q columns of dqkv and the key/value gradients this
// rank's queries give every rank's rows (dkv_all, kv_all's layout); the layer
// reduce-scatters dkv_all over the group and unpacks its own block into the
// k and v columns of dqkv (kv_unpack).
//
// Results, precision and dtypes as flash_attention_forward/backward
// (kernels/attention.h): lse (B, H, 2L) is F32 beside 16-bit storage, else
// the storage dtype; scores scaled by 1/sqrt(D); on the CPU one task per
// (batch, head) forward and per (batch, key/value head) backward, softmax
// sums, delta and the dk/dv sums over a group's query heads in double, so
// the result does not depend on the thread count. With c = 1 it is causal
// flash attention over the whole sequence.
//
//   kv_pack(ctx, kv, qkv, H, KV);                                  // kv (B, 2L, 2 KV D)
//   cp.all_gather(kv, kv_all);                                      // kv_all (c, B, 2L, 2 KV D)
//   cp_attention_forward(ctx, out, lse, qkv, kv_all, split, rank, H, KV);
//   cp_attention_backward(ctx, dqkv, dkv_all, dout, qkv, kv_all, out, lse, split, rank, H, KV);
//   cp.reduce_scatter(dkv_all, dkv);                                 // dkv (B, 2L, 2 KV D)
//   kv_unpack(ctx, dqkv, dkv, H, KV);
#pragma once

#include "kernels/context.h"
#include "kernels/context_split.h"

namespace xirang {

// out (B, 2L, H D), lse (B, H, 2L); qkv's k and v columns are not read (kv_all holds them).
// n_kv_head 0 means n_head.
void cp_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, const Tensor& kv_all,
                          const ContextSplit& split, int rank, int n_head, int n_kv_head = 0);
// dqkv's q columns overwritten (its k and v columns untouched); dkv_all
// (c, B, 2L, 2 KV D) overwritten: the gradient of every gathered key and value
// from this rank's queries (zero for keys no local query attends to).
void cp_attention_backward(const KernelContext& ctx, Tensor dqkv, Tensor dkv_all, const Tensor& dout,
                           const Tensor& qkv, const Tensor& kv_all, const Tensor& out, const Tensor& lse,
                           const ContextSplit& split, int rank, int n_head, int n_kv_head = 0);

// The (query, key) pairs of one (batch, head) of `rank`: causal_pairs the
// mask keeps (the sum over local rows of position + 1); computed_pairs those
// the float path multiplies (each query block's rows against its keys
// rounded up to 16, masked ones included). For the bench and the balance
// test: equal computed pairs per rank is what makes equal times possible.
struct CpAttentionWork {
  int64_t causal_pairs = 0;
  int64_t computed_pairs = 0;
};
CpAttentionWork cp_attention_work(const ContextSplit& split, int rank);

// kv (B, T, 2 KV D) = the k and v columns of qkv (B, T, (H + 2 KV) D).
void kv_pack(const KernelContext& ctx, Tensor kv, const Tensor& qkv, int n_head, int n_kv_head = 0);
// The k and v columns of dqkv (B, T, (H + 2 KV) D) = dkv (B, T, 2 KV D); its q columns untouched.
void kv_unpack(const KernelContext& ctx, Tensor dqkv, const Tensor& dkv, int n_head, int n_kv_head = 0);

}  // namespace xirang
