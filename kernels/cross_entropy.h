// kernels/cross_entropy.h: softmax cross entropy over the vocabulary, fused
// with its gradient.
//
// logits (N, Vp) where only the first `vocab_size` columns are real (the rest
// pad the vocabulary to a multiple of 128 and take no part in the softmax).
// targets (N) int32 in [0, vocab_size).
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
