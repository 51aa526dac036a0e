// core/device_memory.h: raw allocation on a device (used by Arena), copies
// between host and device, and pinned staging buffers for uploads.
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
// A host buffer that feeds a device: page-locked (so copies from it are
// asynchronous DMA) when `device` is a GPU, plain host memory otherwise,
// allocated once. upload() queues a copy on a stream and returns at once;
// wait_reusable() blocks until every queued copy has read the buffer, so the
// host may refill it.
//
//   staging.wait_reusable();                 // the previous microbatch's copy is done
//   fill(staging.data());
//   staging.upload(tokens.raw(), 0, bytes, stream);
class HostStaging {
 public:
  HostStaging() = default;
  HostStaging(size_t bytes, Device device);
  ~HostStaging();
  HostStaging(HostStaging&& o) noexcept;
  HostStaging& operator=(HostStaging&& o) noexcept;
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // Copies bytes [offset, offset + n) of the buffer to `dst` on the device, in order on `stream`.
  void upload(void* dst, size_t offset, size_t n, void* stream);
  void wait_reusable();

 private:
  void release() noexcept;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::CPU;
  void* event_ = nullptr;  // cudaEvent_t recorded after the last upload
  bool pending_ = false;
};

// True when this build has the CUDA backend and a device is visible.
bool cuda_available();

}  // namespace xirang
