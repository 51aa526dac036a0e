// kernels/decode_attention_checks.h: the shapes of decode_attention_forward,
// checked once for the CPU and the CUDA implementations (private to kernels/).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/attention_checks.h"

namespace xirang::decode_attention_checks {

struct Dims {
  attention_checks::Dims a;  // B, n new tokens (as T), H, KV, D, qkv row width W
  int64_t T_max = 0;         // cache positions
  int64_t pos = 0;           // tokens cached before this call
  int64_t KVD() const { return a.KV * a.D; }
  int64_t L(int64_t i) const { return pos + i + 1; }  // keys new token i attends to
};

inline Dims check(const char* op, const Tensor& out, const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                  int64_t pos, int n_head, int n_kv_head) {
  Dims d{attention_checks::check_dims(op, qkv, n_head, n_kv_head)};
  const int64_t B = d.a.B, n = d.a.T;
  check_shape(op, "out", out, {B, n, d.a.C});
  if (k_cache.rank() != 3 || k_cache.size(0) != B || k_cache.size(2) != d.KVD())
    fail(ErrorKind::Shape, op, ": k_cache must be (B, T_max, n_kv_head * head_dim) = (", B, ", T_max, ", d.KVD(),
         "), got ", k_cache.shape().str());
  check_same_shape(op, v_cache, k_cache);
  d.T_max = k_cache.size(1);
  d.pos = pos;
  if (pos < 0 || pos + n > d.T_max)
    fail(ErrorKind::Shape, op, ": positions [", pos, ", ", pos + n, ") of ", n, " new tokens after ", pos,
         " cached do not fit a cache of ", d.T_max, " positions");
  check_dtype(op, "out", out, qkv.dtype());
  check_dtype(op, "k_cache", k_cache, qkv.dtype());
  check_dtype(op, "v_cache", v_cache, qkv.dtype());
  return d;
}

}  // namespace xirang::decode_attention_checks
