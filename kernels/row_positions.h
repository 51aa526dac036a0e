// kernels/row_positions.h: the sequence position of each row of a run of
// token rows, for the ops that read positions (add_positions, rope), on the
// host and in CUDA kernels (private to kernels/).
//
// Row i of a run that starts at flattened row row_offset of sequences of
// seq_len rows is local row t = (row_offset + i) % seq_len of its sequence.
// Its position is t itself, plus pos_offset (rope), or for a
// context-parallel rank's rows (seq_len = split.local_rows()) the global
// position split.position(rank, t).
#pragma once

#include <cstdint>

#include "kernels/context_split.h"

namespace xirang {

struct RowPositions {
  int64_t seq_len = 1;
  int64_t row_offset = 0;
  int64_t pos_offset = 0;
  bool cp = false;  // positions by split and rank
  ContextSplit split;
  int rank = 0;

  static RowPositions plain(int64_t seq_len, int64_t row_offset, int64_t pos_offset = 0) {
    return {seq_len, row_offset, pos_offset, false, ContextSplit{}, 0};
  }
  static RowPositions context(const ContextSplit& s, int rank, int64_t row_offset = 0) {
    return {s.local_rows(), row_offset, 0, true, s, rank};
  }
  XR_SPLIT_HD int64_t operator()(int64_t i) const {
    const int64_t t = (row_offset + i) % seq_len;
    return cp ? split.position(rank, t) : pos_offset + t;
  }
  // Rows of the table the run can reach (one past the largest position).
  int64_t table_rows() const { return cp ? split.seq_len : pos_offset + seq_len; }
};

}  // namespace xirang
