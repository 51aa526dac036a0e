// kernels/rope_checks.h: the shapes of the rotary-embedding tensors, checked
// once for the CPU and the CUDA implementations (private to kernels/).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cp_attention_checks.h"
#include "kernels/row_positions.h"

namespace xirang::rope_checks {

struct TableDims {
  int64_t positions, half;  // T_max, D/2
};

// cos and sin (T_max, D/2), the same shape and dtype.
inline TableDims check_table(const char* op, const Tensor& cos, const Tensor& sin) {
  if (cos.rank() != 2 || cos.size(0) < 1 || cos.size(1) < 1)
    fail(ErrorKind::Shape, op, ": cos must be (T_max, D/2) with both > 0, got ", cos.shape().str());
  check_same_shape(op, sin, cos);
  check_dtype(op, "sin", sin, cos.dtype());
  return {cos.size(0), cos.size(1)};
}

// What the rotation needs: rows of `width` elements whose first rot_heads
// heads of 2 * half elements are rotated; row r at position
// pos_offset + r % seq_len (pos), or on a context-parallel rank's rows
// split.position(rank, r % local_rows).
struct ApplyDims {
  int64_t rows, width, rot_heads, half, seq_len, pos_offset;
  RowPositions pos;
};

inline ApplyDims check_positions(const char* op, const Tensor& x, const TableDims& t, int64_t seq_len,
                                 int64_t pos_offset) {
  if (x.rank() < 1) fail(ErrorKind::Shape, op, ": x must have at least one dimension, got ", x.shape().str());
  const Tensor x2 = x.flat2d();
  const int64_t rows = x2.size(0);
  if (seq_len < 1 || rows % seq_len != 0)
    fail(ErrorKind::Shape, op, ": ", rows, " rows of ", x.shape().str(), " are not whole sequences of seq_len ",
         seq_len);
  if (pos_offset < 0 || pos_offset + seq_len > t.positions)
    fail(ErrorKind::Shape, op, ": positions [", pos_offset, ", ", pos_offset + seq_len, ") are outside the table's ",
         t.positions);
  return {rows, x2.size(1), 0, t.half, seq_len, pos_offset, RowPositions::plain(seq_len, 0, pos_offset)};
}

// x (.., H*D): every head rotated.
inline ApplyDims check_heads(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                             int64_t pos_offset) {
  const TableDims t = check_table(op, cos, sin);
  ApplyDims d = check_positions(op, x, t, seq_len, pos_offset);
  if (d.width % (2 * t.half) != 0)
    fail(ErrorKind::Shape, op, ": rows of ", d.width, " are not whole heads of D = ", 2 * t.half,
         " (twice the table's width)");
  d.rot_heads = d.width / (2 * t.half);
  return d;
}

// qkv (.., (n_head + 2 n_kv_head) D): the q and k heads rotated.
inline ApplyDims check_qkv(const char* op, const Tensor& qkv, const Tensor& cos, const Tensor& sin, int n_head,
                           int n_kv_head, int64_t seq_len, int64_t pos_offset) {
  const TableDims t = check_table(op, cos, sin);
  ApplyDims d = check_positions(op, qkv, t, seq_len, pos_offset);
  if (n_head < 1 || n_kv_head < 1)
    fail(ErrorKind::Shape, op, ": n_head ", n_head, " and n_kv_head ", n_kv_head, " must be >= 1");
  const int64_t D = 2 * t.half;
  if (d.width != (int64_t(n_head) + 2 * int64_t(n_kv_head)) * D)
    fail(ErrorKind::Shape, op, ": qkv rows of ", d.width, " are not (n_head ", n_head, " + 2 n_kv_head ", n_kv_head,
         ") heads of D = ", D);
  d.rot_heads = int64_t(n_head) + n_kv_head;
  return d;
}

// qkv (B * split.local_rows(), (n_head + 2 n_kv_head) D) of a context-parallel
// rank: positions by the split, the table covering the whole sequence.
inline ApplyDims check_qkv_context(const char* op, const Tensor& qkv, const Tensor& cos, const Tensor& sin, int n_head,
                                   int n_kv_head, const ContextSplit& split, int rank) {
  cp_attention_checks::check_split(op, split, rank);
  const TableDims t = check_table(op, cos, sin);
  if (split.seq_len > t.positions)
    fail(ErrorKind::Shape, op, ": the sequence's ", split.seq_len, " positions are outside the table's ", t.positions);
  ApplyDims d = check_qkv(op, qkv, cos, sin, n_head, n_kv_head, split.local_rows(), 0);
  d.pos = RowPositions::context(split, rank);
  return d;
}

}  // namespace xirang::rope_checks
