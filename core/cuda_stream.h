// core/cuda_stream.h: RAII CUDA streams and events, and the event joins that
// overlap uses (CUDA builds only).
//
// Overlap between compute and communication is expressed on the device, with
// events, never with host synchronization: a producer stream records an
// event after the work whose result another stream needs, and the consumer
// stream waits on that event (cudaStreamWaitEvent). The host only queues both
// and returns at once.
//
//   CudaStream compute(device), comm(device, StreamPriority::High);
//   CudaEvent grads_ready;
//   ... backward kernels on compute.get() ...
//   stream_wait(comm.get(), compute.get(), grads_ready);  // comm runs after them
//   ... all-reduce on comm.get() ...
//
// Timing: an event made with EventTiming::Enabled carries a timestamp;
// elapsed_ms(start, end) is the device time between two completed ones (they
// may be on different streams of the same device). Timing events cost a
// little more, so events are plain (EventTiming::Disabled) unless asked.
#pragma once

#include <cuda_runtime.h>

namespace xirang {

// Makes `device` the calling thread's current device for the scope and
// restores the previous one afterwards (CUDA calls act on the current device).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

// The scheduler prefers blocks of a High stream over Normal ones when both
// have work ready: communication streams use High so that their (small, long
// running) kernels are not starved by compute kernels that fill the device.
enum class StreamPriority { Normal, High };
enum class EventTiming { Disabled, Enabled };

class CudaEvent {
 public:
  // An event on the current device.
  explicit CudaEvent(EventTiming timing = EventTiming::Disabled);
  ~CudaEvent();
  CudaEvent(CudaEvent&& o) noexcept;
  CudaEvent& operator=(CudaEvent&& o) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  EventTiming timing() const { return timing_; }
  // Captures the work queued on `stream` so far; the event completes when it
  // has run. Recording again replaces the capture for later waits only:
  // a wait already queued keeps the capture it saw.
  void record(cudaStream_t stream);
  // True once the captured work has completed (also for a never-recorded
  // event); throws ErrorKind::Library on a CUDA error.
  bool query() const;
  // The host blocks until the captured work has completed. Rarely right:
  // tests, shutdown, reading a value back. Use stream_wait to order streams.
  void synchronize() const;

 private:
  cudaEvent_t event_ = nullptr;
  EventTiming timing_ = EventTiming::Disabled;
};

// Work queued on `waiter` after this call starts only once `event`'s captured
// work has completed. The host does not block.
void stream_wait(cudaStream_t waiter, const CudaEvent& event);
// Records `event` on `producer` and makes `waiter` wait on it: `waiter`'s
// later work runs after everything queued on `producer` so far. Nothing
// happens when the two are the same stream (a stream is already in order).
void stream_wait(cudaStream_t waiter, cudaStream_t producer, CudaEvent& event);
// Milliseconds of device time from `start` to `end`, both timing events and
// both completed; throws ErrorKind::Internal for a non-timing event and
// ErrorKind::Library (cudaErrorNotReady) when one has not completed yet.
float elapsed_ms(const CudaEvent& start, const CudaEvent& end);

class CudaStream {
 public:
  // A stream on `device` that does not synchronize with the legacy default
  // stream (cudaStreamNonBlocking), so work on stream 0 never serializes it.
  explicit CudaStream(int device, StreamPriority priority = StreamPriority::Normal);
  ~CudaStream();  // queued work still runs; the stream is released after it
  CudaStream(CudaStream&& o) noexcept;
  CudaStream& operator=(CudaStream&& o) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  StreamPriority priority() const { return priority_; }
  // This stream's later work waits for `event` (device-side, see stream_wait).
  void wait(const CudaEvent& event) const { stream_wait(stream_, event); }
  // The host blocks until everything queued so far has run.
  void synchronize() const;

 private:
  void release() noexcept;

  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  StreamPriority priority_ = StreamPriority::Normal;
};

}  // namespace xirang
