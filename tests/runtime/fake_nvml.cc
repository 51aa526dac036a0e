// A stand-in for libnvidia-ml.so.1 with the calls runtime/observe/energy_meter.cc
// makes: an energy counter that advances by a set amount at every read, a
// fixed power reading, and results the test chooses (fake_nvml.h).
#include "tests/runtime/fake_nvml.h"

#include <time.h>

#include <cstring>

namespace {
FakeNvmlState state;
int dummy_device = 0;
constexpr int kNotSupported = 3;  // NVML_ERROR_NOT_SUPPORTED
}  // namespace

extern "C" {

__attribute__((visibility("default"))) FakeNvmlState* fake_nvml_state() { return &state; }

__attribute__((visibility("default"))) int nvmlInit_v2() {
  ++state.inits;
  return state.init_result;
}

__attribute__((visibility("default"))) int nvmlShutdown() {
  ++state.shutdowns;
  return 0;
}

__attribute__((visibility("default"))) const char* nvmlErrorString(int rc) {
  switch (rc) {
    case 0: return "Success";
    case 2: return "Invalid Argument";
    case kNotSupported: return "Not Supported";
    case 9: return "Driver Not Loaded";
  }
  return "Unknown Error";
}

__attribute__((visibility("default"))) int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  std::strncpy(state.bus_id, bus_id, sizeof state.bus_id - 1);
  *device = &dummy_device;
  return 0;
}

__attribute__((visibility("default"))) int nvmlDeviceGetHandleByIndex_v2(unsigned index, void** device) {
  if (index != 0) return 2;
  *device = &dummy_device;
  return 0;
}

__attribute__((visibility("default"))) int nvmlDeviceGetTotalEnergyConsumption(void* device, unsigned long long* mj) {
  if (device != &dummy_device) return 2;
  ++state.energy_reads;
  if (state.energy_result != 0) return state.energy_result;
  state.energy_mj += state.mj_per_read;
  *mj = state.energy_mj;
  return 0;
}

__attribute__((visibility("default"))) int nvmlDeviceGetPowerUsage(void* device, unsigned* mw) {
  if (device != &dummy_device) return 2;
  ++state.power_reads;
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const double now = double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  if (state.last_power_read_s > 0 && now - state.last_power_read_s > state.max_power_read_gap_s)
    state.max_power_read_gap_s = now - state.last_power_read_s;
  state.last_power_read_s = now;
  if (state.power_result != 0) return state.power_result;
  *mw = state.power_mw;
  return 0;
}
}
