#include "models/layers/loss.h"

#include "kernels/cross_entropy.h"
#include "kernels/matmul.h"

namespace xirang {

void VocabParallelLoss::layout(Arena& acts, const TpComm& tp, DType wide) {
  if (!tp.split()) return;
  ce_max_ = acts.alloc({tp.rows()}, wide, "softmax row max");
  ce_sums_ = acts.alloc({tp.rows(), 2}, wide, "softmax sums");
}

void VocabParallelLoss::forward(const KernelContext& ctx, TpComm& tp, const Parameter& table, Tensor logits,
                                Tensor losses, const Tensor& x_full, const Tensor& targets, double dloss) const {
  linear_forward(ctx, logits, x_full, table.value, Tensor());
  const Tensor tg = targets.view({tp.rows()});
  Tensor dlogits = dloss > 0 ? logits : Tensor();
  if (!tp.split()) {
    cross_entropy_forward_backward(ctx, losses, dlogits, logits, tg, vocab_, dloss);
    return;
  }
  // Only (N) and (N, 2) statistics cross ranks.
  const int64_t vb = int64_t(tp.rank()) * (padded_ / tp.size());
  cross_entropy_shard_max(ctx, ce_max_, logits, vb, vocab_);
  tp.all_reduce(ce_max_, ReduceOp::Max);
  cross_entropy_shard_sums(ctx, ce_sums_, logits, tg, ce_max_, vb, vocab_);
  tp.all_reduce(ce_sums_, ReduceOp::Sum);
  cross_entropy_shard_finish(ctx, losses, dlogits, logits, tg, ce_max_, ce_sums_, vb, vocab_, dloss);
}

void VocabParallelLoss::backward(const KernelContext& ctx, TpComm& tp, Parameter& table, const Tensor& dlogits,
                                 const Tensor& x_full, WeightGradQueue* later) const {
  linear_backward(ctx, tp.partial(), later ? Tensor() : table.grad, Tensor(), dlogits, x_full, table.value,
                  GradMode::Overwrite);
  if (later) later->product(ctx, table.grad, table.value, dlogits, x_full);
}

}  // namespace xirang
