// models/layers/embedding.h: the vocabulary-parallel token embedding and
// learned position embeddings.
//
// The token table (Vp, C) is split by rows over the tensor-parallel group:
// a rank looks up the tokens its rows hold and writes zero rows for the
// others, and the lookups are reduced into the local rows (all-reduce, or
// reduce-scatter under sequence parallelism). The padded rows past the
// real vocabulary stay zero: no token selects them.
//
//   VocabParallelEmbedding wte(vocab, padded_vocab);
//   wte.declare(list, "wte.weight", C);
//   LearnedPositions wpe;  wpe.declare(list, "wpe.weight", max_seq_len, C);
//   wte.bind(params);  wpe.bind(params);
//   wte.forward(ctx, tp, x, tokens);                    // x (R, C)
//   wpe.forward(ctx, x, T, /*row_offset=*/tp.rank() * R);
#pragma once

#include <string>
#include <vector>

#include "kernels/context.h"
#include "models/layers/param_list.h"
#include "models/layers/tp_comm.h"

namespace xirang {

class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(int vocab, int padded_vocab) : vocab_(vocab), padded_(padded_vocab) {}
  // The table (Vp, C), rows split; normal(0.02) over the real rows, layer -1
  // (an untied head's table: the layer whose gradients become final with it).
  void declare(ParamList& list, const std::string& name, int64_t width, int layer = -1);
  void bind(std::vector<Parameter>& params);
  Parameter& table() const { return *table_; }
  ParamRef table_ref() const { return ref_; }
  int vocab() const { return vocab_; }
  // The first vocabulary row this rank holds.
  int64_t vocab_begin(const TpComm& tp) const { return int64_t(tp.rank()) * (padded_ / tp.size()); }

  // x (R, C) = the rows of `tokens` (B, T) int32, reduced over the group.
  void forward(const KernelContext& ctx, TpComm& tp, Tensor x, const Tensor& tokens) const;
  // The table's gradient from dy_full, the gradient of all N rows (every
  // rank's shard serves tokens from any row).
  void backward(const KernelContext& ctx, const TpComm& tp, const Tensor& dy_full, const Tensor& tokens) const;

 private:
  int vocab_, padded_;
  ParamRef ref_;
  Parameter* table_ = nullptr;  // (Vp/P, C)
};

class LearnedPositions {
 public:
  // The table (max_seq_len, C), replicated; normal(0.01), layer -1.
  void declare(ParamList& list, const std::string& name, int64_t max_seq_len, int64_t width);
  void bind(std::vector<Parameter>& params);
  // x (R, C) += positions of its rows: row i is row row_offset + i of the
  // flattened (B, split.local_rows()) rows of a cp rank's share of each
  // sequence (kernels/context_split.h; the whole sequence in order at c = 1).
  void forward(const KernelContext& ctx, Tensor x, const ContextSplit& split, int cp_rank, int64_t row_offset) const;
  // dy_full: all (B * local_rows, C) rows.
  void backward(const KernelContext& ctx, const Tensor& dy_full, const ContextSplit& split, int cp_rank) const;

 private:
  ParamRef ref_;
  Parameter* table_ = nullptr;  // (max_seq_len, C)
};

}  // namespace xirang
