// CudaContext: stream, cuBLASLt handle and workspace, created once.
#include "kernels/cuda/context.h"

#include "core/device_memory.h"
#include "kernels/cuda/common.cuh"

namespace xirang {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error for later callers
    return 0;
  }
  return n;
}

CudaContext::CudaContext(int device) {
  init(device);
  cudaError_t rc = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (rc != cudaSuccess) {
    release();
    fail(ErrorKind::Library, "CudaContext: cannot create a stream on device ", device, ": ", cudaGetErrorString(rc));
  }
  owns_stream_ = true;
}

CudaContext::CudaContext(int device, cudaStream_t stream) {
  XR_CHECK(stream != nullptr, "CudaContext: pass a created stream (the legacy default stream would serialize with every other stream)");
  init(device);
  stream_ = stream;
}

void CudaContext::init(int device) {
  const int n = cuda_device_count();
  if (device < 0 || device >= n)
    fail(ErrorKind::Config, "CUDA device ", device, " does not exist (", n, " visible)");
  device_ = device;
  XR_CUDA_CHECK(cudaSetDevice(device));
  cublasLtHandle_t h = nullptr;
  XR_CUBLAS_CHECK(cublasLtCreate(&h));
  blas_ = h;
  try {
    workspace_ = device_alloc(Device::CUDA, kWorkspaceBytes, "the cuBLASLt workspace");
  } catch (...) {
    cublasLtDestroy(h);
    throw;
  }
}

CudaContext::~CudaContext() { release(); }

void CudaContext::release() noexcept {
  // Never throws: failures here (a lost device) are ignored. Work still
  // queued may use the workspace, so it drains first.
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  if (workspace_) device_free(Device::CUDA, workspace_);
  if (blas_) cublasLtDestroy(static_cast<cublasLtHandle_t>(blas_));
  if (owns_stream_ && stream_) cudaStreamDestroy(stream_);
  workspace_ = blas_ = nullptr;
  stream_ = nullptr;
}

KernelContext CudaContext::kernel_context() const {
  KernelContext k;
  k.device = Device::CUDA;
  k.cuda_stream = stream_;
  k.blas_handle = blas_;
  k.blas_workspace = workspace_;
  k.blas_workspace_bytes = kWorkspaceBytes;
  return k;
}

void CudaContext::synchronize() const { XR_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

}  // namespace xirang
