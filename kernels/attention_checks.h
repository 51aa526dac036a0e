// kernels/attention_checks.h: the shape of a packed qkv tensor, checked once
// for the CPU and the CUDA attention (private to kernels/).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"

namespace xirang::attention_checks {

struct Dims {
  int64_t B, T, C, H, D;  // batch, tokens, width, heads, head dim
};

// qkv (B, T, 3C) with C divisible by n_head.
inline Dims check_dims(const char* op, const Tensor& qkv, int n_head) {
  if (qkv.rank() != 3 || qkv.size(2) % 3 != 0)
    fail(ErrorKind::Shape, op, ": qkv must be (B, T, 3C), got ", qkv.shape().str());
  Dims d{qkv.size(0), qkv.size(1), qkv.size(2) / 3, n_head, 0};
  if (n_head <= 0 || d.C % n_head != 0)
    fail(ErrorKind::Shape, op, ": width ", d.C, " is not divisible by n_head ", n_head);
  d.D = d.C / n_head;
  return d;
}

}  // namespace xirang::attention_checks
