// kernels/cp_attention_checks.h: the shapes of the context-parallel
// attention's tensors, checked once for the CPU and the CUDA implementations
// (private to kernels/).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/attention_checks.h"
#include "kernels/context_split.h"

namespace xirang::cp_attention_checks {

// The split itself and this rank's place in it.
inline void check_split(const char* op, const ContextSplit& s, int rank) {
  if (s.ranks < 1 || s.seq_len < 1)
    fail(ErrorKind::Shape, op, ": split of ", s.seq_len, " tokens over ", s.ranks, " ranks (expected both >= 1)");
  if (s.ranks > 1 && s.seq_len % (2 * int64_t(s.ranks)) != 0)
    fail(ErrorKind::Shape, op, ": sequence length ", s.seq_len, " is not a multiple of 2 * cp = ", 2 * s.ranks);
  if (rank < 0 || rank >= s.ranks) fail(ErrorKind::Shape, op, ": rank ", rank, " is outside the cp group of ", s.ranks);
}

// A rank's qkv (B, T/c, (H + 2 KV) D) and the gathered kv_all (c, B, T/c, 2 KV D).
struct CpDims {
  attention_checks::Dims d;  // of the local qkv: d.T = the split's local rows
  int64_t c = 1;             // ranks
  int64_t kvw = 0;           // a kv row: 2 KV D
};

inline CpDims check_dims(const char* op, const Tensor& qkv, const Tensor& kv_all, const ContextSplit& s, int rank,
                         int n_head, int n_kv_head) {
  check_split(op, s, rank);
  CpDims cd{attention_checks::check_dims(op, qkv, n_head, n_kv_head), s.ranks, 0};
  const attention_checks::Dims& d = cd.d;
  cd.kvw = 2 * d.KV * d.D;
  if (d.T != s.local_rows())
    fail(ErrorKind::Shape, op, ": qkv has ", d.T, " rows per sequence, the split gives each rank ", s.local_rows(),
         " (", s.seq_len, " tokens over ", s.ranks, " ranks)");
  check_shape(op, "kv_all", kv_all, {cd.c, d.B, d.T, cd.kvw});
  check_dtype(op, "kv_all", kv_all, qkv.dtype());
  return cd;
}

// kv (B, T, 2 KV D) beside qkv (B, T, (H + 2 KV) D), for kv_pack and kv_unpack.
inline attention_checks::Dims check_kv(const char* op, const Tensor& qkv, const Tensor& kv, int n_head,
                                       int n_kv_head) {
  attention_checks::Dims d = attention_checks::check_dims(op, qkv, n_head, n_kv_head);
  check_shape(op, "kv", kv, {d.B, d.T, 2 * d.KV * d.D});
  check_dtype(op, "kv", kv, qkv.dtype());
  return d;
}

}  // namespace xirang::cp_attention_checks
