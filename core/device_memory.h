// core/device_memory.h: raw allocation on a device, used only by Arena.
#pragma once

#include <cstddef>
#include <string_view>

#include "core/tensor.h"

namespace xirang {

// Allocates `bytes` on `device` (host memory is aligned and pre-faulted);
// throws ErrorKind::Memory naming `what` on failure.
void* device_alloc(Device device, size_t bytes, std::string_view what);
void device_free(Device device, void* p);
// Copies `bytes` from `src` on device `from` to `dst` on device `to`. A copy
// that involves the GPU is queued on `stream` (a cudaStream_t) and, when
// `wait`, completes before the call returns (the host may then read or
// reuse the host side). With a null stream the device is synchronized
// first and the copy always completes before the return (safe, slow: for
// set-up, checkpoints and groups of one). Host to host is a memmove.
void copy_bytes(void* dst, Device to, const void* src, Device from, size_t bytes, void* stream = nullptr,
                bool wait = true);
// The same for tensors of equal byte size.
inline void copy_tensor(const Tensor& dst, const Tensor& src, void* stream = nullptr, bool wait = true) {
  if (dst.bytes() != src.bytes())
    fail(ErrorKind::Shape, "copy_tensor: ", src.str(), " into ", dst.str(), " (sizes differ)");
  copy_bytes(dst.raw(), dst.device(), src.raw(), src.device(), src.bytes(), stream, wait);
}
// True when this build has the CUDA backend and a device is visible.
bool cuda_available();

}  // namespace xirang
