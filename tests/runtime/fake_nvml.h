// tests/runtime/fake_nvml.h: the control of the fake NVML library
// (fake_nvml.cc, built as libxirang_fake_nvml.so for the energy meter's
// tests). A test opens the same library with dlopen, looks up
// fake_nvml_state and sets how the fake answers before it builds a meter.
#pragma once

extern "C" {

struct FakeNvmlState {
  int init_result = 0;               // nvmlInit_v2's return (0: success)
  int energy_result = 0;             // nvmlDeviceGetTotalEnergyConsumption's (3: not supported)
  int power_result = 0;              // nvmlDeviceGetPowerUsage's
  unsigned long long energy_mj = 0;  // the counter: advances by mj_per_read at every read
  unsigned long long mj_per_read = 0;
  unsigned power_mw = 0;             // what every power reading returns
  int energy_reads = 0, power_reads = 0;
  // When the power was last read and the longest time between two reads
  // (CLOCK_MONOTONIC seconds): how late a loaded machine ran the sampler.
  double last_power_read_s = 0, max_power_read_gap_s = 0;
  int inits = 0, shutdowns = 0;
  char bus_id[64] = "";              // the last bus id a handle was asked for
};

// The fake's one state; the tests reset it between cases.
FakeNvmlState* fake_nvml_state();
}
