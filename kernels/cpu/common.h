// kernels/cpu/common.h: helpers shared by the CPU kernels (private to kernels/cpu).
//
// dispatch_storage() turns the run-time dtype into the storage type S once, at
// the op boundary; compute_t<S> is the type arithmetic happens in (float for
// F32, BF16 and F16; double for F64), following kernels/context.h:
//   dispatch_storage(x.dtype(), "gelu_forward", [&](auto tag) {
//     using S = decltype(tag);  using C = compute_t<S>;
//     C v = load(px[i]);  py[i] = store<S>(v); });
// For F32 and F64, load() and store() are the identity, so the float paths
// compile to the same code as before the 16-bit types were added.
//
// Reductions over rows (parameter gradients, norms) are split into a fixed
// number of chunks whatever the thread count, and the chunk partials are
// added in order, so results are bitwise reproducible for a given layout.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/context.h"

// The public ops are defined in kernels/cpu/; each one hands a CUDA
// context to its CUDA implementation (kernels/cuda/ops.h) first:
//   XR_ON_CUDA(ctx, matmul(ctx, out, a, b, trans_a, trans_b, alpha, beta));
// In a build without CUDA the line is nothing, and require_cpu() refuses a
// CUDA context with a clear error.
#ifdef XIRANG_HAVE_CUDA
#include "kernels/cuda/ops.h"
#define XR_ON_CUDA(ctx, call) \
  if ((ctx).device == ::xirang::Device::CUDA) return ::xirang::cuda::call
#else
#define XR_ON_CUDA(ctx, call) static_cast<void>(0)
#endif

namespace xirang::cpu {

// ---------------------------------------------------------------- types

template <class S>
constexpr bool is_16bit_v = std::is_same_v<S, bf16> || std::is_same_v<S, f16>;

inline bool is_16bit(DType t) { return t == DType::BF16 || t == DType::F16; }

template <class S>
struct compute_of {
  using type = S;  // float, double
};
template <>
struct compute_of<bf16> {
  using type = float;
};
template <>
struct compute_of<f16> {
  using type = float;
};
// The arithmetic type of storage type S; also the dtype of the values saved
// for backward and of the loss statistics (F32 when S is 16-bit, else S).
template <class S>
using compute_t = typename compute_of<S>::type;

inline DType stat_dtype(DType s) { return is_16bit(s) ? DType::F32 : s; }

// ---------------------------------------------------------------- conversions

inline float f16_bits_to_float(uint16_t b) {
#if defined(__F16C__)
  return _cvtsh_ss(b);
#else
  return f16_to_float(f16{b});
#endif
}
inline f16 float_to_f16_inline(float f) {
#if defined(__F16C__)
  return f16{uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
#else
  return float_to_f16(f);
#endif
}

// A stored value widened to its compute type (exact).
inline float load(bf16 x) { return bf16_to_float(x); }
inline float load(f16 x) { return f16_bits_to_float(x.bits); }
inline float load(float x) { return x; }
inline double load(double x) { return x; }

// A float rounded to storage type S (to nearest even; one rounding).
template <class S>
inline S store(float v) {
  if constexpr (std::is_same_v<S, bf16>) return float_to_bf16(v);
  else if constexpr (std::is_same_v<S, f16>) return float_to_f16_inline(v);
  else return S(v);
}

// d rounded to float with round-to-odd: truncate, then set the last bit when
// anything was cut off. Rounding that float once more to a type with at
// least two fewer significant bits (bf16: 8, f16: 11, against float's 24)
// gives the correctly rounded result of d, so a double goes to a 16-bit type
// with one rounding, not two.
inline float round_to_odd_float(double d) {
  float f = float(d);
  if (double(f) == d || !std::isfinite(f)) return f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::fabs(double(f)) > std::fabs(d)) --u;  // rounded away from zero: step back (magnitude bits)
  u |= 1u;
  std::memcpy(&f, &u, 4);
  return f;
}

// A double rounded to storage type S with one rounding.
template <class S>
inline S store(double v) {
  if constexpr (is_16bit_v<S>) return store<S>(round_to_odd_float(v));
  else return S(v);
}

// n values widened into float (for the 16-bit BLAS paths).
template <class S>
inline void load_row(const S* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<S, f16>)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = load(src[i]);
}

// n floats rounded into storage type S.
template <class S>
inline void store_row(const float* src, S* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<S, f16>)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = store<S>(src[i]);
}

// ---------------------------------------------------------------- dispatch

// F32, F64, BF16 and F16: f(S{}) with the storage type.
template <class F>
void dispatch_storage(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::BF16: f(bf16{}); break;
    case DType::F16: f(f16{}); break;
    default:
      fail(ErrorKind::Shape, op, ": dtype ", dtype_name(t), " is not supported on the CPU (expected f32, f64, bf16 or f16)");
  }
}

// The older form for ops that only take F32 and F64.
template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    default: fail(ErrorKind::Shape, op, ": dtype ", dtype_name(t), " is not supported on the CPU (expected f32 or f64)");
  }
}

// A parameter-gradient output for activations of dtype s: s itself, or F32
// when s is 16-bit (the model accumulates 16-bit training's gradients in F32).
inline void check_grad_dtype(const char* op, const char* what, const Tensor& g, DType s) {
  if (g.dtype() == s || (g.dtype() == DType::F32 && is_16bit(s))) return;
  fail(ErrorKind::Shape, op, ": ", what, " has dtype ", dtype_name(g.dtype()), " for ", dtype_name(s),
       " activations (expected ", dtype_name(s), is_16bit(s) ? " or f32)" : ")");
}

// A saved statistic or loss output: F32 for 16-bit activations, else their dtype.
inline void check_stat_dtype(const char* op, const char* what, const Tensor& t, DType s) {
  check_dtype(op, what, t, stat_dtype(s));
}

// The gradient storage G of a tensor checked by check_grad_dtype: f(G{})
// with G = S or, for 16-bit S, float.
template <class S, class F>
void dispatch_grad(DType g, F&& f) {
  if constexpr (is_16bit_v<S>) {
    if (g == DType::F32) return f(float{});
  }
  f(S{});
}

inline void require_cpu(const KernelContext& ctx, const char* op) {
  if (ctx.device != Device::CPU) fail(ErrorKind::Internal, op, ": called on a ", device_name(ctx.device), " context");
}

// ---------------------------------------------------------------- reductions and scratch

// Fixed chunking of n rows for deterministic reductions.
constexpr int64_t kReduceChunks = 32;
inline int64_t chunk_begin(int64_t n, int64_t c) { return n * c / kReduceChunks; }

// Scratch slots: buffers that one op uses at the same time get different slots.
enum ScratchSlot : int { kScratchDefault = 0, kScratchA, kScratchB, kScratchC, kScratchReduce, kScratchIndex };

// A per-thread scratch vector that only grows (no allocation in steady state).
// Contents are unspecified on entry.
template <class T, int Slot = kScratchDefault>
T* thread_scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace xirang::cpu
