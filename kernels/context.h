// kernels/context.h: what every op receives besides its tensors.
//
// Ops take the context explicitly (no global handles). On the CPU it carries
// nothing that must be set; on CUDA it carries the stream to launch on and
// the cuBLASLt handle and workspace.
#pragma once

#include "core/tensor.h"

namespace xirang {

struct KernelContext {
  Device device = Device::CPU;
  void* cuda_stream = nullptr;  // cudaStream_t on CUDA
  void* blas_handle = nullptr;  // cublasLtHandle_t on CUDA
};

// Whether a gradient output is overwritten or added to. Parameter gradients
// always accumulate (over microbatches); activation gradients say which.
enum class GradMode { Overwrite, Accumulate };

}  // namespace xirang
