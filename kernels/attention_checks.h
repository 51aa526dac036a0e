// kernels/attention_checks.h: the shape of a packed qkv tensor, checked once
// for the CPU and the CUDA attention (private to kernels/).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"

namespace xirang::attention_checks {

// A token's qkv row is [q_0 .. q_{H-1} | k_0 .. k_{KV-1} | v_0 .. v_{KV-1}],
// each slice D wide; query head h reads key/value head h / (H / KV).
struct Dims {
  int64_t B, T, C, H, D;  // batch, tokens, query width H D (= out's width), query heads, head dim
  int64_t KV = 0;         // key/value heads
  int64_t W = 0;          // qkv row width (H + 2 KV) D

  int64_t group() const { return H / KV; }  // query heads per key/value head
  int64_t kv_head(int64_t h) const { return h / group(); }
  // Offsets of head slices within a qkv row.
  int64_t q_off(int64_t h) const { return h * D; }
  int64_t k_off(int64_t g) const { return C + g * D; }
  int64_t v_off(int64_t g) const { return C + (KV + g) * D; }
};

// qkv (B, T, (H + 2 KV) D); n_kv_head 0 means n_head (multi-head attention).
inline Dims check_dims(const char* op, const Tensor& qkv, int n_head, int n_kv_head = 0) {
  const int kv = n_kv_head == 0 ? n_head : n_kv_head;
  if (n_head <= 0 || kv <= 0 || n_head % kv != 0)
    fail(ErrorKind::Shape, op, ": n_head ", n_head, " is not a positive multiple of n_kv_head ", kv);
  const int64_t heads = int64_t(n_head) + 2 * int64_t(kv);
  if (qkv.rank() != 3 || qkv.size(2) % heads != 0)
    fail(ErrorKind::Shape, op, ": qkv must be (B, T, (n_head + 2 n_kv_head) head_dim) with n_head ", n_head,
         " and n_kv_head ", kv, ", got ", qkv.shape().str());
  Dims d{qkv.size(0), qkv.size(1), 0, n_head, qkv.size(2) / heads, kv, qkv.size(2)};
  d.C = d.H * d.D;
  return d;
}

// The backward's operands against qkv's dims: dqkv shaped like qkv, dout and
// out (B, T, C), lse (B, H, T); dqkv, dout and out in qkv's dtype (lse's
// dtype differs by backend: the callers check it).
inline void check_backward_operands(const char* op, const Dims& d, const Tensor& dqkv, const Tensor& dout,
                                    const Tensor& qkv, const Tensor& out, const Tensor& lse) {
  check_same_shape(op, dqkv, qkv);
  check_shape(op, "dout", dout, {d.B, d.T, d.C});
  check_shape(op, "out", out, {d.B, d.T, d.C});
  check_shape(op, "lse", lse, {d.B, d.H, d.T});
  check_dtype(op, "dqkv", dqkv, qkv.dtype());
  check_dtype(op, "dout", dout, qkv.dtype());
  check_dtype(op, "out", out, qkv.dtype());
}

}  // namespace xirang::attention_checks
