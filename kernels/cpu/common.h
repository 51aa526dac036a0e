// kernels/cpu/common.h: helpers shared by the CPU kernels (private to kernels/cpu).
//
// dispatch_float() turns the run-time dtype into the compute type once, at the
// op boundary:
//   dispatch_float(x.dtype(), "gelu_forward", [&](auto tag) {
//     using T = decltype(tag);  gelu<T>(x.data<T>(), ...); });
//
// Reductions over rows (parameter gradients, norms) are split into a fixed
// number of chunks whatever the thread count, and the chunk partials are
// added in order, so results are bitwise reproducible for a given layout.
#pragma once

#include <omp.h>

#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/context.h"

namespace xirang::cpu {

template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    default: fail(ErrorKind::Shape, op, ": dtype ", dtype_name(t), " is not supported on the CPU (expected f32 or f64)");
  }
}

inline void require_cpu(const KernelContext& ctx, const char* op) {
  if (ctx.device != Device::CPU) fail(ErrorKind::Internal, op, ": called on a ", device_name(ctx.device), " context");
}

// Fixed chunking of n rows for deterministic reductions.
constexpr int64_t kReduceChunks = 32;
inline int64_t chunk_begin(int64_t n, int64_t c) { return n * c / kReduceChunks; }

// A per-thread scratch vector that only grows (no allocation in steady state).
template <class T>
T* thread_scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace xirang::cpu
