// kernels/cuda/context.h: CudaContext, the owner of what a CUDA KernelContext
// points at: a stream, a cuBLASLt handle and a workspace.
//
// A CudaContext is created once per device (per compute stream) at start-up
// and hands out KernelContexts, which are plain views and cheap to copy:
//
//   CudaContext cuda(local_rank);                 // own non-blocking stream
//   KernelContext ctx = cuda.kernel_context();
//   linear_forward(ctx, y, x, w, b);              // queued on cuda.stream()
//   cuda.synchronize();
//
//   CudaContext on_compute(local_rank, compute_stream);  // borrows a stream
//
// The workspace (kWorkspaceBytes, allocated once) is cuBLASLt's workspace and
// also the scratch of the kernels' own multi-pass reductions (bias
// gradients, sum_squares, the embedding backward's sort). Every op queues its
// work on the context's one stream, so stream order keeps those users apart:
// two streams must never share one CudaContext.
//
// Built only when XIRANG_HAVE_CUDA is defined.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/context.h"

namespace xirang {

// Number of visible CUDA devices; 0 when there is none or the driver cannot
// be used (cudaGetDeviceCount fails), so it is safe on machines without a GPU.
int cuda_device_count();

class CudaContext {
 public:
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;

  // Makes `device` current on this thread and creates a non-blocking stream.
  explicit CudaContext(int device = 0);
  // Same, but queues work on `stream`, which the caller owns and keeps alive
  // for the lifetime of this context.
  CudaContext(int device, cudaStream_t stream);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  KernelContext kernel_context() const;
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // Waits for everything queued on this context's stream.
  void synchronize() const;

 private:
  void init(int device);
  void release() noexcept;

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  void* blas_ = nullptr;       // cublasLtHandle_t
  void* workspace_ = nullptr;  // kWorkspaceBytes of device memory
};

}  // namespace xirang
