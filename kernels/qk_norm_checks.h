// kernels/qk_norm_checks.h: the shapes of the per-head q/k RMSNorm tensors,
// checked once for the CPU and the CUDA implementations (private to
// kernels/). Dtypes are each backend's own: the CPU has an F64 path, CUDA
// keeps rstd in F32.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"

namespace xirang::qk_norm_checks {

struct Dims {
  int64_t tokens;  // rows of qkv: B T
  int64_t width;   // (H + 2 KV) D
  int64_t D;       // head_dim
  int64_t H, KV;   // local query and key/value heads
  int64_t normed() const { return H + KV; }  // heads per token with an rstd
};

// qkv (.., (H + 2 KV) D), q_w and k_w (D), rstd with tokens * (H + KV)
// elements; n_head, n_kv_head >= 1.
inline Dims check_shapes(const char* op, const Tensor& qkv, const Tensor& q_w, const Tensor& k_w, const Tensor& rstd,
                         int n_head, int n_kv_head) {
  if (qkv.rank() < 1) fail(ErrorKind::Shape, op, ": qkv must have at least one dimension, got ", qkv.shape().str());
  if (n_head < 1 || n_kv_head < 1)
    fail(ErrorKind::Shape, op, ": n_head ", n_head, " and n_kv_head ", n_kv_head, " must be >= 1");
  if (q_w.rank() != 1 || q_w.size(0) < 1)
    fail(ErrorKind::Shape, op, ": q_w must be (D) with D >= 1, got ", q_w.shape().str());
  const int64_t D = q_w.size(0);
  check_shape(op, "k_w", k_w, {D});
  const Tensor x2 = qkv.flat2d();
  const Dims d{x2.size(0), x2.size(1), D, n_head, n_kv_head};
  if (d.width != (d.H + 2 * d.KV) * D)
    fail(ErrorKind::Shape, op, ": qkv rows of ", d.width, " are not (n_head ", n_head, " + 2 n_kv_head ", n_kv_head,
         ") heads of D = ", D, " (the size of q_w)");
  check_shape(op, "rstd", rstd.flat(), {d.tokens * d.normed()});
  if (D > (int64_t(1) << 30)) fail(ErrorKind::Shape, op, ": heads of ", D, " elements are too wide");
  return d;
}

inline void check_eps(const char* op, double eps) {
  if (!(eps >= 0) || !std::isfinite(eps)) fail(ErrorKind::Shape, op, ": eps must be finite and >= 0, got ", eps);
}

// The in-place forms the ops accept: out is qkv, or dqkv is dout only when
// it is overwritten (accumulating into the tensor being read is meaningless).
inline bool same_storage(const Tensor& a, const Tensor& b) { return a.raw() == b.raw(); }

inline void check_backward_alias(const char* op, const Tensor& dqkv, const Tensor& dout, bool accumulate) {
  if (accumulate && same_storage(dqkv, dout))
    fail(ErrorKind::Shape, op, ": dqkv is dout; accumulating into it needs a separate dqkv");
}

}  // namespace xirang::qk_norm_checks
