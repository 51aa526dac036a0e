// kernels/context.h: what every op receives besides its tensors, and the
// precision rules every op follows on every backend.
//
// Ops take the context explicitly (no global handles). On the CPU it carries
// nothing that must be set; on CUDA it carries the stream to launch on and
// the cuBLASLt handle and workspace.
//
// Precision rules (the same on the CPU and on CUDA):
// - An op's activations and parameters share one storage dtype S: F32, BF16
//   or F16 (and F64 on the CPU, for reference runs and gradient checks).
// - Arithmetic is float for F32/BF16/F16 (double for F64); reductions
//   (LayerNorm statistics, row sums, softmax sums, norms, gradient sums over
//   rows) accumulate in double on the CPU and in float or wider on CUDA.
//   16-bit results are rounded to nearest even once, when stored.
// - Parameter-gradient outputs (linear dw/dbias, LayerNorm dw/db, embedding
//   dwte/dwpe) have dtype S or F32: under BF16/F16 the model accumulates its
//   gradients in F32 over microbatches.
// - Values saved for backward (LayerNorm mean/rstd, attention log-sum-exp),
//   per-token losses and cross-entropy row statistics are F32 when S is
//   16-bit, else S.
#pragma once

#include "core/step_clock.h"
#include "core/tensor.h"
#include "core/timeline.h"

namespace xirang {

struct KernelContext {
  Device device = Device::CPU;
  void* cuda_stream = nullptr;  // cudaStream_t on CUDA
  void* blas_handle = nullptr;  // cublasLtHandle_t on CUDA
  void* blas_workspace = nullptr;    // device memory cuBLASLt may use
  size_t blas_workspace_bytes = 0;
  // Where ops add their time under metrics.op_profile, and the runtime its
  // spans under metrics.trace (core/timeline.h); null: nothing is recorded.
  Timeline* timeline = nullptr;
  // The step's clock (core/step_clock.h): layers open the parts they run
  // inside a pass (tensor-parallel collectives); null: none.
  StepClock* clock = nullptr;
};

// Whether a gradient output is overwritten or added to. Parameter gradients
// always accumulate (over microbatches); activation gradients say which.
enum class GradMode { Overwrite, Accumulate };

}  // namespace xirang
