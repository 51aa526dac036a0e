#include "core/device_memory.h"

#include <cstdlib>
#include <cstring>

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
  // Zeroed like host memory: alignment padding inside flat buffers must read as zero.
  XR_CUDA_CHECK(cudaMemset(p, 0, bytes));
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

bool cuda_available() {
#ifdef XIRANG_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

}  // namespace xirang
