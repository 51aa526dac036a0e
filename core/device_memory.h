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
// True when this build has the CUDA backend and a device is visible.
bool cuda_available();

}  // namespace xirang
