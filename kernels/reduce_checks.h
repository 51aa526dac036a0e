// kernels/reduce_checks.h: the argument checks of the accumulating
// reductions (sum_squares_accumulate, mean_accumulate), shared by the CPU and
// the CUDA implementations (private to kernels/).
#pragma once

#include "core/error.h"
#include "core/tensor.h"

namespace xirang::reduce_checks {

// `acc` is one F64 element on the same device as `x`; with `wide_only`, x is
// F32 or F64 (the per-token losses the model keeps).
inline void check_accumulate(const char* op, const Tensor& acc, const Tensor& x, bool wide_only) {
  check_dtype(op, "acc", acc, DType::F64);
  if (acc.numel() != 1) fail(ErrorKind::Shape, op, ": acc must hold one element, got shape ", acc.shape().str());
  if (acc.device() != x.device())
    fail(ErrorKind::Shape, op, ": acc is in ", device_name(acc.device()), " memory but x in ", device_name(x.device()));
  if (wide_only && x.dtype() != DType::F32 && x.dtype() != DType::F64)
    fail(ErrorKind::Shape, op, ": x has dtype ", dtype_name(x.dtype()), " (expected f32 or f64)");
}

}  // namespace xirang::reduce_checks
