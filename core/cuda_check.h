// core/cuda_check.h: the CUDA runtime check (CUDA builds only).
//
//   XR_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
//
// XR_CUDA_SYNC_CHECK() additionally synchronizes the device when the
// XIRANG_CUDA_SYNC debug switch is on, pinning asynchronous faults to the
// launch that caused them.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define XR_CUDA_CHECK(call) XR_LIB_CHECK("CUDA", call, rc == cudaSuccess, cudaGetErrorString(rc))

namespace xirang {
bool cuda_sync_debug();  // reads the debug switch once
}

#define XR_CUDA_LAUNCH_CHECK()                                          \
  do {                                                                  \
    XR_CUDA_CHECK(cudaGetLastError());                                  \
    if (::xirang::cuda_sync_debug()) XR_CUDA_CHECK(cudaDeviceSynchronize()); \
  } while (0)
