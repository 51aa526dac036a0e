// kernels/moe_checks.h: the shapes and dtypes of the MoE kernels' tensors
// (kernels/moe.h), checked once for the CPU and the CUDA implementations
// (private to kernels/).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/moe.h"

namespace xirang::moe_checks {

inline DType gate_dtype(DType rows) { return rows == DType::F64 ? DType::F64 : DType::F32; }

inline void check_2d(const char* op, const char* what, const Tensor& t) {
  if (t.rank() != 2) fail(ErrorKind::Shape, op, ": ", what, " must be 2-D, got ", t.shape().str());
}

struct RouterDims {
  int64_t T, E, k;
};

// logits (T, E) F32/F64; ids, gates (T, k); scores (T, E); counts (E) or undefined.
inline RouterDims check_router(const char* op, const Tensor& logits, const Tensor& ids, const Tensor& gates,
                               const Tensor& scores, const RouterOptions& opt) {
  check_2d(op, "logits", logits);
  const int64_t T = logits.size(0), E = logits.size(1), k = opt.top_k;
  if (logits.dtype() != DType::F32 && logits.dtype() != DType::F64)
    fail(ErrorKind::Shape, op, ": logits have dtype ", dtype_name(logits.dtype()),
         " (routing runs in f32, or f64 for checks)");
  if (k < 1 || k > E) fail(ErrorKind::Shape, op, ": top_k is ", k, ", expected 1 <= top_k <= experts (", E, ")");
  check_shape(op, "ids", ids, {T, k});
  check_dtype(op, "ids", ids, DType::I32);
  check_shape(op, "gates", gates, {T, k});
  check_dtype(op, "gates", gates, logits.dtype());
  check_shape(op, "scores", scores, {T, E});
  check_dtype(op, "scores", scores, logits.dtype());
  return {T, E, k};
}

struct RowDims {
  int64_t T, k, d;
};

// x (T, d) token rows; xp (T*k, d) expert-ordered rows; an index of T*k I32.
inline RowDims check_rows(const char* op, const Tensor& x, const Tensor& xp, const char* index_name,
                          const Tensor& index) {
  check_2d(op, "token rows", x);
  check_2d(op, "expert rows", xp);
  const int64_t T = x.size(0), d = x.size(1);
  check_dtype(op, index_name, index, DType::I32);
  if (index.rank() != 1) fail(ErrorKind::Shape, op, ": ", index_name, " must be 1-D, got ", index.shape().str());
  const int64_t n = index.size(0);
  if (T == 0 ? n != 0 : n % T != 0)
    fail(ErrorKind::Shape, op, ": ", index_name, " has ", n, " slots for ", T, " tokens (expected tokens * top_k)");
  check_shape(op, "expert rows", xp, {n, d});
  check_dtype(op, "expert rows", xp, x.dtype());
  if (index.device() == Device::CPU) {  // rows are read by these values (a device index comes from moe_permutation)
    const int32_t* v = index.data<int32_t>();
    for (int64_t i = 0; i < n; ++i)
      if (v[i] < 0 || v[i] >= n)
        fail(ErrorKind::Shape, op, ": ", index_name, "[", i, "] is ", v[i], ", expected 0 <= value < ", n);
  }
  return {T, T == 0 ? 0 : n / T, d};
}

// moe_permutation's tensors: ids (any shape, I32: n slots), sorted_slots
// and slot_rows (n) I32, offsets (E + 1) I32. Returns n.
inline int64_t check_permutation(const char* op, const Tensor& sorted_slots, const Tensor& slot_rows,
                                 const Tensor& offsets, const Tensor& ids, int64_t num_experts) {
  check_dtype(op, "ids", ids, DType::I32);
  const int64_t n = ids.numel();
  check_shape(op, "sorted_slots", sorted_slots, {n});
  check_dtype(op, "sorted_slots", sorted_slots, DType::I32);
  check_shape(op, "slot_rows", slot_rows, {n});
  check_dtype(op, "slot_rows", slot_rows, DType::I32);
  check_shape(op, "offsets", offsets, {num_experts + 1});
  check_dtype(op, "offsets", offsets, DType::I32);
  return n;
}

// The experts' weight gradient: the rows' dtype, or F32 beside 16-bit rows
// (kernels/cpu/common.h's rule for every parameter gradient).
inline void check_weight_grad(const char* op, const Tensor& dw, DType rows) {
  const bool sixteen = rows == DType::BF16 || rows == DType::F16;
  if (dw.dtype() == rows || (dw.dtype() == DType::F32 && sixteen)) return;
  fail(ErrorKind::Shape, op, ": dw has dtype ", dtype_name(dw.dtype()), " for ", dtype_name(rows),
       " rows (expected ", dtype_name(rows), sixteen ? " or f32)" : ")");
}

struct GroupedDims {
  int64_t R, E, in, out;
};

// x (R, in), w (E, in, out), y (R, out), offsets (E+1) I32 on the host.
inline GroupedDims check_grouped(const char* op, const Tensor& x, const Tensor& w, const char* y_name, const Tensor& y,
                                 const Tensor& offsets) {
  check_2d(op, "x", x);
  if (w.rank() != 3) fail(ErrorKind::Shape, op, ": w must be (experts, in, out), got ", w.shape().str());
  const int64_t R = x.size(0), E = w.size(0), in = w.size(1), out = w.size(2);
  if (x.size(1) != in) fail(ErrorKind::Shape, op, ": x has ", x.size(1), " features but w ", w.shape().str(), " expects ", in);
  check_shape(op, y_name, y, {R, out});
  check_dtype(op, "w", w, x.dtype());
  check_dtype(op, y_name, y, x.dtype());
  check_shape(op, "offsets", offsets, {E + 1});
  check_dtype(op, "offsets", offsets, DType::I32);
  if (offsets.device() != Device::CPU) fail(ErrorKind::Shape, op, ": offsets must be in host memory");
  const int32_t* o = offsets.data<int32_t>();
  if (o[0] != 0 || o[E] != R)
    fail(ErrorKind::Shape, op, ": offsets run from ", o[0], " to ", o[E], ", expected 0 to ", R, " (the rows of x)");
  for (int64_t e = 0; e < E; ++e)
    if (o[e + 1] < o[e]) fail(ErrorKind::Shape, op, ": offsets decrease at expert ", e, " (", o[e], " then ", o[e + 1], ")");
  return {R, E, in, out};
}

}  // namespace xirang::moe_checks
