// runtime/observe/energy_meter.h: a GPU's energy, read through NVML.
//
// NVML is loaded at run time (dlopen), so the build needs neither its
// headers nor its library, and a machine without the driver still runs.
// The meter reads the device's total energy counter (millijoules since the
// driver loaded; Volta and newer). Where that counter is not supported it
// integrates the board power (nvmlDeviceGetPowerUsage, milliwatts) sampled
// by a thread of its own. The meter knows nothing of CUDA: the code that
// owns the device passes its PCI bus id (cudaDeviceGetPCIBusId).
//
//   EnergyMeter meter("libnvidia-ml.so.1", "0000:3B:00.0");
//   if (!meter.measuring()) warn(meter.reason());      // why there are no readings
//   EnergySpan step(&meter);                           // a step's start
//   ...
//   std::optional<StepEnergy> e = step.take(tokens);   // joules, J/token, W
//
// The energy is the whole GPU's: several processes sharing one device each
// read all of it.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "runtime/observe/metrics.h"  // StepEnergy

namespace xirang {

enum class EnergySource {
  None,          // not measuring: reason() says why
  Counter,       // nvmlDeviceGetTotalEnergyConsumption
  PowerSamples,  // nvmlDeviceGetPowerUsage, integrated over time by a sampling thread
};
const char* energy_source_name(EnergySource s);  // "nvml energy counter", "nvml power samples", "none"

class EnergyMeter {
 public:
  struct Options {
    double sample_period_s = 0.02;  // PowerSamples: time between two power readings
  };
  // Opens `library` (dlopen), initialises NVML and finds the device by
  // `pci_bus_id` (empty: the device of index 0). Never throws for a missing
  // or failing NVML: the meter is then not measuring, and reason() names
  // the step that failed and NVML's or the loader's message.
  EnergyMeter(const std::string& library, const std::string& pci_bus_id, Options opts);
  EnergyMeter(const std::string& library, const std::string& pci_bus_id)
      : EnergyMeter(library, pci_bus_id, Options{}) {}
  ~EnergyMeter();  // stops the sampler, shuts NVML down, closes the library
  EnergyMeter(const EnergyMeter&) = delete;
  EnergyMeter& operator=(const EnergyMeter&) = delete;

  bool measuring() const { return source_ != EnergySource::None; }
  EnergySource source() const { return source_; }
  const std::string& reason() const { return reason_; }
  // The device's energy since the meter started, in joules; none when not
  // measuring or when the reading fails.
  std::optional<double> joules();

 private:
  struct Nvml;  // the library handle and its functions
  bool open(const std::string& library, const std::string& pci_bus_id);
  void sample_power();  // the sampler thread's loop

  std::unique_ptr<Nvml> nvml_;
  EnergySource source_ = EnergySource::None;
  std::string reason_;
  unsigned long long start_mj_ = 0;  // Counter: the reading at start
  // PowerSamples: the integral up to the last sample, and that sample.
  Options opts_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  double sampled_j_ = 0;
  double last_w_ = 0, last_t_ = 0;
  std::thread sampler_;
};

// An interval of a meter (a training step), from construction to take():
// its joules, those over `tokens`, and those over its wall time. A null
// meter (the CPU backend, or NVML unavailable) gives no reading.
class EnergySpan {
 public:
  explicit EnergySpan(EnergyMeter* meter);
  std::optional<StepEnergy> take(double tokens) const;

 private:
  EnergyMeter* meter_;
  std::optional<double> start_j_;
  double start_s_ = 0;
};

}  // namespace xirang
