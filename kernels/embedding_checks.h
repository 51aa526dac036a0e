// kernels/embedding_checks.h: the argument checks of the embedding ops,
// shared by the CPU and the CUDA implementations (private to kernels/).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cp_attention_checks.h"
#include "kernels/context_split.h"

namespace xirang::embedding_checks {

// A table (rows, C): wte, wpe or their gradients.
inline void check_table(const char* op, const char* what, const Tensor& t) {
  if (t.rank() != 2) fail(ErrorKind::Shape, op, ": ", what, " must be a 2-D table, got ", t.shape().str());
}

// `t` holds N rows of width C: (B, T, C) activations or (N, C) row slices.
inline void check_rows(const char* op, const char* what, const Tensor& t, int64_t N, int64_t C) {
  if (t.rank() < 1 || t.size(-1) != C || t.numel() != N * C)
    fail(ErrorKind::Shape, op, ": ", what, " ", t.shape().str(), " is not ", N, " rows of width ", C);
}

inline void check_shard(const char* op, int64_t vocab_begin, int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_begin < 0)
    fail(ErrorKind::Shape, op, ": vocab_begin ", vocab_begin, " and vocab_size ", vocab_size,
         " must satisfy vocab_begin >= 0 and vocab_size > 0");
}

inline void check_positions(const char* op, const char* what, const Tensor& table, int64_t C, int64_t seq_len,
                            int64_t row_offset) {
  check_table(op, what, table);
  if (seq_len <= 0 || row_offset < 0)
    fail(ErrorKind::Shape, op, ": seq_len ", seq_len, " must be positive and row_offset ", row_offset,
         " non-negative");
  if (table.size(0) < seq_len || table.size(1) != C)
    fail(ErrorKind::Shape, op, ": ", what, " ", table.shape().str(), " cannot cover ", seq_len,
         " positions of width ", C);
}

// A context-parallel rank's rows: the split valid, the rank in it and the
// table covering the whole sequence.
inline void check_context_positions(const char* op, const char* what, const Tensor& table, const ContextSplit& s,
                                    int rank, int64_t row_offset) {
  cp_attention_checks::check_split(op, s, rank);
  if (row_offset < 0) fail(ErrorKind::Shape, op, ": row_offset ", row_offset, " is negative");
  if (table.size(0) < s.seq_len)
    fail(ErrorKind::Shape, op, ": ", what, " ", table.shape().str(), " cannot cover ", s.seq_len, " positions");
}

}  // namespace xirang::embedding_checks
