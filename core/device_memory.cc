#include "core/device_memory.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#ifdef XIRANG_HAVE_CUDA
#include "core/cuda_check.h"
#endif

namespace xirang {

void* device_alloc(Device device, size_t bytes, std::string_view what) {
  if (device == Device::CPU) {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) fail(ErrorKind::Memory, "cannot allocate ", bytes, " bytes of host memory for ", what);
    // Touch every page now: first-touch faults are slow here and must not land inside a timed step.
    std::memset(p, 0, bytes);
    return p;
  }
#ifdef XIRANG_HAVE_CUDA
  void* p = nullptr;
  cudaError_t rc = cudaMalloc(&p, bytes);
  if (rc != cudaSuccess)
    fail(ErrorKind::Memory, "cannot allocate ", bytes, " bytes of GPU memory for ", what, ": ", cudaGetErrorString(rc));
  // Zeroed like host memory: alignment padding inside flat buffers must read
  // as zero. cudaMemset may return before the fill and is not ordered with
  // the non-blocking streams the kernels use, so the fill is waited for.
  XR_CUDA_CHECK(cudaMemset(p, 0, bytes));
  XR_CUDA_CHECK(cudaDeviceSynchronize());
  return p;
#else
  fail(ErrorKind::Config, "this build has no CUDA backend (configure with -DXIRANG_CUDA=ON where nvcc exists)");
#endif
}

void device_free(Device device, void* p) {
  if (device == Device::CPU) {
    std::free(p);
    return;
  }
#ifdef XIRANG_HAVE_CUDA
  cudaFree(p);
#endif
}

void copy_bytes(void* dst, Device to, const void* src, Device from, size_t bytes, void* stream, bool wait) {
  if (bytes == 0) return;
  if (to == Device::CPU && from == Device::CPU) {
    std::memmove(dst, src, bytes);
    return;
  }
#ifdef XIRANG_HAVE_CUDA
  auto s = static_cast<cudaStream_t>(stream);
  // Without a stream the copy cannot be ordered after work on the
  // (non-blocking) compute streams, so everything queued finishes first.
  if (!s) XR_CUDA_CHECK(cudaDeviceSynchronize());
  XR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  if (wait || !s) XR_CUDA_CHECK(cudaStreamSynchronize(s));
#else
  (void)stream, (void)wait;
  fail(ErrorKind::Internal, "copy_bytes: a ", device_name(from), " -> ", device_name(to),
       " copy in a build without CUDA");
#endif
}

HostStaging::HostStaging(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  if (device == Device::CPU) {
    data_ = device_alloc(Device::CPU, bytes, "host staging");
    return;
  }
#ifdef XIRANG_HAVE_CUDA
  XR_CUDA_CHECK(cudaHostAlloc(&data_, bytes, cudaHostAllocDefault));
  cudaEvent_t e = nullptr;
  XR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  event_ = e;
#else
  fail(ErrorKind::Config, "this build has no CUDA backend (configure with -DXIRANG_CUDA=ON where nvcc exists)");
#endif
}

HostStaging::~HostStaging() { release(); }

HostStaging::HostStaging(HostStaging&& o) noexcept { *this = std::move(o); }

HostStaging& HostStaging::operator=(HostStaging&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    event_ = o.event_;
    pending_ = o.pending_;
    o.data_ = o.event_ = nullptr;
    o.bytes_ = 0;
    o.pending_ = false;
  }
  return *this;
}

void HostStaging::release() noexcept {
  if (!data_) return;
#ifdef XIRANG_HAVE_CUDA
  if (device_ != Device::CPU) {
    if (pending_) cudaEventSynchronize(static_cast<cudaEvent_t>(event_));  // a copy may still read the buffer
    cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    cudaFreeHost(data_);
    data_ = nullptr;
    return;
  }
#endif
  device_free(Device::CPU, data_);
  data_ = nullptr;
}

void HostStaging::upload(void* dst, size_t offset, size_t n, void* stream) {
  XR_CHECK(offset + n <= bytes_, "HostStaging::upload: [", offset, ", ", offset + n, ") outside ", bytes_, " bytes");
  if (device_ == Device::CPU) {
    std::memcpy(dst, static_cast<char*>(data_) + offset, n);
    return;
  }
#ifdef XIRANG_HAVE_CUDA
  auto s = static_cast<cudaStream_t>(stream);
  XR_CUDA_CHECK(cudaMemcpyAsync(dst, static_cast<char*>(data_) + offset, n, cudaMemcpyHostToDevice, s));
  XR_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), s));
  pending_ = true;
#endif
}

void HostStaging::wait_reusable() {
  if (!pending_) return;
#ifdef XIRANG_HAVE_CUDA
  XR_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
#endif
  pending_ = false;
}

bool cuda_available() {
#ifdef XIRANG_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

}  // namespace xirang
