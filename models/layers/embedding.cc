#include "models/layers/embedding.h"

#include "kernels/embedding.h"

namespace xirang {

void VocabParallelEmbedding::declare(ParamList& list, const std::string& name, int64_t width, int layer) {
  ref_ = list.add(name, list.split({padded_, width}, 0), true, layer, InitRule::normal(0.02, int64_t(vocab_) * width));
}

void VocabParallelEmbedding::bind(std::vector<Parameter>& params) { table_ = &ref_.in(params); }

void VocabParallelEmbedding::forward(const KernelContext& ctx, TpComm& tp, Tensor x, const Tensor& tokens) const {
  // Rows of tokens another rank holds are zero here; under sequence
  // parallelism the N looked-up rows are reduce-scattered into the R local ones.
  Tensor dst = tp.sequence_parallel() ? tp.partial() : x;
  embedding_lookup(ctx, dst, tokens.view({tp.rows()}), table_->value, vocab_begin(tp), vocab_);
  tp.reduce_rows(dst, x);
}

void VocabParallelEmbedding::backward(const KernelContext& ctx, const TpComm& tp, const Tensor& dy_full,
                                      const Tensor& tokens) const {
  embedding_lookup_backward(ctx, table_->grad, dy_full, tokens.view({tp.rows()}), vocab_begin(tp), vocab_);
}

void LearnedPositions::declare(ParamList& list, const std::string& name, int64_t max_seq_len, int64_t width) {
  ref_ = list.add(name, list.whole({max_seq_len, width}), true, -1, InitRule::normal(0.01));
}

void LearnedPositions::bind(std::vector<Parameter>& params) { table_ = &ref_.in(params); }

// One rank keeps the whole-sequence ops (their sums' order is the golden losses').
void LearnedPositions::forward(const KernelContext& ctx, Tensor x, const ContextSplit& split, int cp_rank,
                               int64_t row_offset) const {
  if (split.ranks > 1) add_positions(ctx, x, table_->value, split, cp_rank, row_offset);
  else add_positions(ctx, x, table_->value, split.seq_len, row_offset);
}

void LearnedPositions::backward(const KernelContext& ctx, const Tensor& dy_full, const ContextSplit& split,
                                int cp_rank) const {
  if (split.ranks > 1) add_positions_backward(ctx, table_->grad, dy_full, split, cp_rank, 0);
  else add_positions_backward(ctx, table_->grad, dy_full, split.seq_len, 0);
}

}  // namespace xirang
