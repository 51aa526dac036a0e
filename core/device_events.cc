#include "core/device_events.h"

#include <deque>

#include "core/error.h"
#ifdef XIRANG_HAVE_CUDA
#include "core/cuda_stream.h"
#endif

namespace xirang {

#ifdef XIRANG_HAVE_CUDA
struct DeviceEvents::Pool {
  std::deque<CudaEvent> events;  // a deque: taking one never moves the others
};
#else
struct DeviceEvents::Pool {
  int events = 0;
};
#endif

DeviceEvents::DeviceEvents() : pool_(std::make_unique<Pool>()) {}
DeviceEvents::~DeviceEvents() = default;

#ifdef XIRANG_HAVE_CUDA
int DeviceEvents::take() {
  pool_->events.emplace_back(EventTiming::Enabled);
  return int(pool_->events.size()) - 1;
}

int DeviceEvents::size() const { return int(pool_->events.size()); }

void DeviceEvents::record(int event, void* stream) {
  XR_CHECK(stream, "a device event recorded without a stream");
  pool_->events.at(size_t(event)).record(static_cast<cudaStream_t>(stream));
}

bool DeviceEvents::done(int event) const { return pool_->events.at(size_t(event)).query(); }

void DeviceEvents::wait(int event) const { pool_->events.at(size_t(event)).synchronize(); }

double DeviceEvents::ms(int from, int to) const {
  return elapsed_ms(pool_->events.at(size_t(from)), pool_->events.at(size_t(to)));
}
#else
int DeviceEvents::take() { return pool_->events++; }

int DeviceEvents::size() const { return pool_->events; }

void DeviceEvents::record(int, void*) { XR_CHECK(false, "a device event recorded in a build without CUDA"); }

bool DeviceEvents::done(int) const { return true; }

void DeviceEvents::wait(int) const {}

double DeviceEvents::ms(int, int) const {
  XR_CHECK(false, "a device time read in a build without CUDA");
  return 0;
}
#endif

}  // namespace xirang
