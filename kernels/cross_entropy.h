// kernels/cross_entropy.h: softmax cross entropy over the vocabulary, fused
// with its gradient.
//
// logits (N, Vp) where only the first `vocab_size` columns are real (the rest
// pad the vocabulary to a multiple of 128 and take no part in the softmax).
// targets (N) int32 in [0, vocab_size). Logits and dlogits are F32, F64,
// BF16 or F16; losses and the row statistics of the sharded form (row_max,
// sums) are F32 when the logits are 16-bit, else the logits' dtype. Sums
// and the log-sum-exp are formed in double; each 16-bit gradient entry,
// the target's included, is rounded once.
//
//   cross_entropy_forward_backward(ctx, losses, dlogits, logits, targets, V, 1.0 / N);
#pragma once

#include "kernels/context.h"

namespace xirang {

// losses (N) = -log softmax(logits)[target]. When dlogits is defined it is
// set to (softmax - onehot(target)) * dloss, padding columns to zero;
// dlogits may alias logits (the logits are then overwritten).
void cross_entropy_forward_backward(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                    const Tensor& targets, int64_t vocab_size, double dloss);

}  // namespace xirang

// Vocabulary-parallel cross entropy: each rank of the tensor-parallel group
// holds the logits of a contiguous vocabulary shard, (N, V_shard) for global
// columns [vocab_begin, vocab_begin + V_shard); columns at or past vocab_size
// are padding. The model reduces between the three phases, so no rank ever
// holds the full logits:
//
//   cross_entropy_shard_max(ctx, row_max, logits, vocab_begin, V);          // then all-reduce Max
//   cross_entropy_shard_sums(ctx, sums, logits, targets, row_max, vocab_begin, V);  // then all-reduce Sum
//   cross_entropy_shard_finish(ctx, losses, dlogits, logits, targets, row_max, sums, vocab_begin, V, dloss);
namespace xirang {

// row_max (N): the largest real logit of each row in this shard (-inf if none).
void cross_entropy_shard_max(const KernelContext& ctx, Tensor row_max, const Tensor& logits, int64_t vocab_begin,
                             int64_t vocab_size);
// sums (N, 2): [sum over this shard's real columns of exp(logit - row_max),
// the target's logit if this shard holds it, else 0]. row_max is the global max.
void cross_entropy_shard_sums(const KernelContext& ctx, Tensor sums, const Tensor& logits, const Tensor& targets,
                              const Tensor& row_max, int64_t vocab_begin, int64_t vocab_size);
// With the global row_max and sums: losses (N) = log(sum_exp) + row_max - target_logit;
// when dlogits is defined, dlogits (N, V_shard) = (softmax - onehot) * dloss over
// this shard (padding columns 0); dlogits may alias logits.
void cross_entropy_shard_finish(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                const Tensor& targets, const Tensor& row_max, const Tensor& sums,
                                int64_t vocab_begin, int64_t vocab_size, double dloss);

}  // namespace xirang
