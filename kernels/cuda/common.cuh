// kernels/cuda/common.cuh: helpers shared by the CUDA kernels (private to kernels/cuda).
//
// Storage types map to CUDA's: F32 -> float, BF16 -> __nv_bfloat16,
// F16 -> __half. Kernels are templated on the storage type S and compute in
// float: load() widens, store() rounds to nearest even.
//
//   dispatch_storage(x.dtype(), "gelu_forward", [&](auto tag) {
//     using S = decltype(tag);
//     gelu_kernel<S><<<grid, block, 0, stream(ctx)>>>(...);
//   });
//   XR_CUDA_LAUNCH_CHECK();
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/context.h"

// cuBLASLt's form of the generic library check (core/error.h).
#define XR_CUBLAS_CHECK(call) XR_LIB_CHECK("cuBLASLt", call, rc == CUBLAS_STATUS_SUCCESS, cublasLtGetStatusString(rc))

namespace xirang::cuda {

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float load(__half x) { return __half2float(x); }

template <class S>
__device__ __forceinline__ S store(float x);
template <>
__device__ __forceinline__ float store<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 store<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half store<__half>(float x) { return __float2half_rn(x); }

// The storage dtypes the CUDA kernels accept (F64 is a CPU-only reference type).
template <class F>
void dispatch_storage(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::BF16: f(__nv_bfloat16{}); break;
    case DType::F16: f(__half{}); break;
    default: fail(ErrorKind::Shape, op, ": dtype ", dtype_name(t), " is not supported on CUDA (expected f32, bf16 or f16)");
  }
}

inline cudaStream_t stream(const KernelContext& ctx) { return static_cast<cudaStream_t>(ctx.cuda_stream); }

inline void require_cuda(const KernelContext& ctx, const char* op) {
  if (ctx.device != Device::CUDA) fail(ErrorKind::Internal, op, ": CUDA kernel called on a ", device_name(ctx.device), " context");
}

// Every defined tensor an op receives must be in CUDA memory (a host view
// here would fault asynchronously, far from the call).
inline void check_on_device(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  for (auto [what, t] : tensors)
    if (t->defined() && t->device() != Device::CUDA)
      fail(ErrorKind::Shape, op, ": ", what, " ", t->str(), " is not in CUDA memory");
}

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// GELU, tanh form, in float with the CPU reference's constants
// (kernels/cpu/elementwise.cc): gelu(x) = 0.5 x (1 + tanh(k (x + a x^3))).
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;
constexpr float kGelu3A = 0.134145f;  // 3 a, rounded once as the CPU's float(3 * 0.044715)

__device__ __forceinline__ float gelu_value(float x) {
  return 0.5f * x * (1.f + tanhf(kGeluK * (x + kGeluA * x * x * x)));
}

// d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2), t = tanh(k (x + a x^3)).
__device__ __forceinline__ float gelu_grad(float x) {
  const float t = tanhf(kGeluK * (x + kGeluA * x * x * x));
  const float du = kGeluK * (1.f + kGelu3A * x * x);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du;
}

// Device scratch for a kernel's own multi-pass work (partial sums, sort
// buffers): the context's cuBLASLt workspace. Everything on one context runs
// on its one stream, so a matmul queued later cannot overwrite scratch that
// an earlier kernel still reads.
inline void* scratch(const KernelContext& ctx, size_t bytes, const char* op) {
  if (bytes > ctx.blas_workspace_bytes || !ctx.blas_workspace)
    fail(ErrorKind::Memory, op, ": needs ", bytes, " bytes of device scratch but the context's workspace has ",
         ctx.blas_workspace_bytes);
  return ctx.blas_workspace;
}

// Bytes rounded up to 256, the alignment of every scratch carve-out.
inline size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace xirang::cuda
