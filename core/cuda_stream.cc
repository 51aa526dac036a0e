#include "core/cuda_stream.h"

#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"

namespace xirang {

CudaDeviceGuard::CudaDeviceGuard(int device) {
  XR_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) {
    XR_CUDA_CHECK(cudaSetDevice(device));
    changed_ = true;
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  // A destructor cannot throw; restoring a device that was valid a moment
  // ago does not fail in practice.
  if (changed_) cudaSetDevice(previous_);
}

// ---- CudaEvent

CudaEvent::CudaEvent(EventTiming timing) : timing_(timing) {
  unsigned flags = timing == EventTiming::Enabled ? cudaEventDefault : cudaEventDisableTiming;
  XR_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags));
}

CudaEvent::~CudaEvent() {
  // Destroying an event whose captured work is still running is allowed: CUDA
  // releases it once that work completes.
  if (event_) cudaEventDestroy(event_);
}

CudaEvent::CudaEvent(CudaEvent&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)), timing_(o.timing_) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  if (this != &o) {
    if (event_) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
    timing_ = o.timing_;
  }
  return *this;
}

void CudaEvent::record(cudaStream_t stream) { XR_CUDA_CHECK(cudaEventRecord(event_, stream)); }

bool CudaEvent::query() const {
  cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    // Not a failure, but the runtime may keep it as the thread's last error,
    // where a later launch check (cudaGetLastError) would report it.
    cudaGetLastError();
    return false;
  }
  XR_CUDA_CHECK(status);
  return true;
}

void CudaEvent::synchronize() const { XR_CUDA_CHECK(cudaEventSynchronize(event_)); }

void stream_wait(cudaStream_t waiter, const CudaEvent& event) {
  XR_CUDA_CHECK(cudaStreamWaitEvent(waiter, event.get(), 0));
}

void stream_wait(cudaStream_t waiter, cudaStream_t producer, CudaEvent& event) {
  if (waiter == producer) return;
  event.record(producer);
  stream_wait(waiter, event);
}

float elapsed_ms(const CudaEvent& start, const CudaEvent& end) {
  if (start.timing() != EventTiming::Enabled || end.timing() != EventTiming::Enabled)
    fail(ErrorKind::Internal, "elapsed_ms needs two timing events (made with EventTiming::Enabled)");
  float ms = 0;
  XR_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), end.get()));
  return ms;
}

// ---- CudaStream

CudaStream::CudaStream(int device, StreamPriority priority) : device_(device), priority_(priority) {
  CudaDeviceGuard guard(device);
  // Numerically lower is higher priority: `greatest` is the highest priority
  // of this device, `least` the default.
  int least = 0, greatest = 0;
  XR_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  int value = priority == StreamPriority::High ? greatest : least;
  XR_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, value));
}

CudaStream::~CudaStream() { release(); }

CudaStream::CudaStream(CudaStream&& o) noexcept
    : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_), priority_(o.priority_) {}

CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  if (this != &o) {
    release();
    stream_ = std::exchange(o.stream_, nullptr);
    device_ = o.device_;
    priority_ = o.priority_;
  }
  return *this;
}

void CudaStream::release() noexcept {
  if (!stream_) return;
  // Returns at once; queued work still runs and the stream is released after
  // it. No host wait here: a stream stuck behind a hung transfer must not
  // hang a destructor (cudaFree of the buffers synchronizes the device anyway).
  cudaStreamDestroy(stream_);
  stream_ = nullptr;
}

void CudaStream::synchronize() const { XR_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

}  // namespace xirang
