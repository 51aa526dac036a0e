// kernels/cpu/cp_attention_blocked.h: context-parallel attention with float
// compute (F32, BF16, F16 storage) as blocks of query rows multiplied on
// AVX2/FMA register tiles (private to kernels/cpu; cp_attention.cc calls it
// after checking the shapes; F64 keeps the row loops as the reference).
//
//   cpu::cp_attention_blocked::forward(cd, split, rank, qkv.data<S>(), kv_all.data<S>(), out.data<S>(), lse);
#pragma once

#include "kernels/context_split.h"
#include "kernels/cp_attention_checks.h"

namespace xirang::cpu::cp_attention_blocked {

// The query blocks: the block that starts at local row t0 ends here (at
// most kQBlock rows, never across the boundary of the rank's two chunks).
int64_t block_end(const ContextSplit& split, int64_t t0);

// (query, key) pairs per (batch, head) that forward multiplies: the blocks' rows x keys rounded up to 16.
int64_t computed_pairs(const ContextSplit& split, int rank);

// out and lse (B, H, T local) of rank `rank`'s queries against kv_all.
template <class S>
void forward(const cp_attention_checks::CpDims& cd, const ContextSplit& split, int rank, const S* pqkv,
             const S* pkv, S* pout, float* plse);

// dq into dqkv's query columns and every rank's dk, dv into dkv_all; one
// task per (batch, key/value head).
template <class S>
void backward(const cp_attention_checks::CpDims& cd, const ContextSplit& split, int rank, S* pdq, S* pdkv,
              const S* pdo, const S* pqkv, const S* pkv, const S* pout, const float* plse);

}  // namespace xirang::cpu::cp_attention_blocked
