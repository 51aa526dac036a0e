// core/device_events.h: the one pool of device timing events a step's
// measurements draw from.
//
// On a device a pass, a wait for communication or a profiled op is only
// queued when the host returns, so its time is a pair of timing events on
// the stream, read once the work has completed. The step's clock owns the
// pool (StepClock::device_events); the pipeline's pass spans, the dp
// joins' waits and the per-op profile each take their events from it once
// and record them again every step, so a step creates no event after the
// first. An event is named by its index, which stays valid for the pool's
// lifetime.
//
// In a build without CUDA, events can be taken (a client sets itself up the
// same way) but recording one fails: no code records without a stream.
//
//   DeviceEvents& ev = clock.device_events();
//   const int a = ev.take(), b = ev.take();   // once
//   ev.record(a, stream); ...queue the pass...; ev.record(b, stream);
//   ...after the step's work has completed: ev.ms(a, b)
#pragma once

#include <memory>

namespace xirang {

class DeviceEvents {
 public:
  DeviceEvents();
  ~DeviceEvents();
  DeviceEvents(const DeviceEvents&) = delete;
  DeviceEvents& operator=(const DeviceEvents&) = delete;

  // A new timing event; its index is the caller's to record again and again.
  int take();
  int size() const;
  // Captures the work queued on `stream` (a cudaStream_t) so far.
  void record(int event, void* stream);
  // True once the captured work has completed (or never recorded).
  bool done(int event) const;
  // The host blocks until it has.
  void wait(int event) const;
  // Device milliseconds from event `from` to event `to`, both completed.
  double ms(int from, int to) const;

 private:
  struct Pool;
  std::unique_ptr<Pool> pool_;
};

}  // namespace xirang
