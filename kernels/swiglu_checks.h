// kernels/swiglu_checks.h: the shapes of the SwiGLU tensors, checked once for
// the CPU and the CUDA implementations (private to kernels/). Both forms
// reduce to rows of F elements of g and u at a row stride (F when g and u
// are separate tensors, 2F inside the packed [g | u] buffer).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/error.h"
#include "core/tensor.h"

namespace xirang::swiglu_checks {

struct Dims {
  int64_t rows, F, stride;  // rows of F outputs; g and u rows `stride` apart
};

// g, u, h, all of one shape and dtype (and dh, dg, du in backward).
inline Dims check_separate(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> same,
                           const Tensor& g) {
  if (g.rank() < 1) fail(ErrorKind::Shape, op, ": g must have at least one dimension, got ", g.shape().str());
  for (auto [what, t] : same) {
    check_same_shape(op, *t, g);
    check_dtype(op, what, *t, g.dtype());
  }
  const Tensor g2 = g.flat2d();
  return {g2.size(0), g2.size(1), g2.size(1)};
}

// gu (.., 2F) and h (.., F; named h_name) with the same leading dimensions; `others`
// (dgu) share gu's shape and dtype.
inline Dims check_packed(const char* op, const char* h_name, const Tensor& h, const Tensor& gu,
                         std::initializer_list<std::pair<const char*, const Tensor*>> others) {
  if (gu.rank() < 1 || gu.size(-1) % 2 != 0)
    fail(ErrorKind::Shape, op, ": gu must have rows of 2F elements [g | u], got ", gu.shape().str());
  Shape hs = gu.shape();
  hs[hs.rank() - 1] = gu.size(-1) / 2;
  check_shape(op, h_name, h, hs);
  check_dtype(op, h_name, h, gu.dtype());
  for (auto [what, t] : others) {
    check_same_shape(op, *t, gu);
    check_dtype(op, what, *t, gu.dtype());
  }
  const Tensor gu2 = gu.flat2d();
  return {gu2.size(0), gu2.size(1) / 2, gu2.size(1)};
}

}  // namespace xirang::swiglu_checks
