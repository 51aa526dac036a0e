// models/layers/loss.h: the language-model head and its cross entropy,
// vocabulary-parallel: logits (N, Vp/P) = x W^T against this rank's rows
// of the (tied) token table, and a softmax whose row max and sums are
// reduced over the group, so that no rank ever holds the full logits.
// Padding logits past the real vocabulary take no part.
//
//   VocabParallelLoss head(vocab, padded_vocab);
//   head.layout(acts, rows, tp, wide_dtype);
//   head.forward(ctx, tp, table, logits, losses, x_full, targets, dloss);   // dloss > 0: dlogits in logits
//   head.backward(ctx, tp, table, logits, x_full);                           // partial dx in tp.partial()
#pragma once

#include "core/arena.h"
#include "kernels/context.h"
#include "models/parameter.h"
#include "models/layers/tp_comm.h"
#include "models/layers/weight_grads.h"

namespace xirang {

class VocabParallelLoss {
 public:
  VocabParallelLoss(int vocab, int padded_vocab) : vocab_(vocab), padded_(padded_vocab) {}
  // The softmax statistics a split vocabulary reduces: (N) and (N, 2).
  void layout(Arena& acts, const TpComm& tp, DType wide);

  // logits = x_full table^T; losses (N) per token; with dloss > 0 the
  // logits are overwritten with their gradient (dloss per token).
  void forward(const KernelContext& ctx, TpComm& tp, const Parameter& table, Tensor logits, Tensor losses,
               const Tensor& x_full, const Tensor& targets, double dloss) const;
  // From the dlogits forward left in `logits`: the table's gradient, and
  // this rank's partial input gradient (N, C) in tp.partial() (`later`:
  // the table's product is left to it).
  void backward(const KernelContext& ctx, TpComm& tp, Parameter& table, const Tensor& dlogits,
                const Tensor& x_full, WeightGradQueue* later = nullptr) const;

 private:
  int vocab_, padded_;
  Tensor ce_max_, ce_sums_;  // (N), (N, 2)
};

}  // namespace xirang
