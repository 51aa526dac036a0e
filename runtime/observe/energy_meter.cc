#include "runtime/observe/energy_meter.h"

#include <dlfcn.h>

#include <chrono>

#include "core/clock.h"
#include "core/error.h"

namespace xirang {

// NVML's C interface, the few calls the meter makes, declared here so that
// the build needs no NVML header (nvml.h: nvmlReturn_t is an enum whose
// success value is 0; a device is an opaque pointer).
namespace {
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
}  // namespace

struct EnergyMeter::Nvml {
  void* lib = nullptr;
  bool initialised = false;
  nvmlDevice_t device = nullptr;
  nvmlReturn_t (*init)() = nullptr;      // nvmlInit_v2
  nvmlReturn_t (*shutdown)() = nullptr;  // nvmlShutdown
  nvmlReturn_t (*by_bus_id)(const char*, nvmlDevice_t*) = nullptr;  // nvmlDeviceGetHandleByPciBusId_v2
  nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t*) = nullptr;      // nvmlDeviceGetHandleByIndex_v2
  nvmlReturn_t (*energy)(nvmlDevice_t, unsigned long long*) = nullptr;  // nvmlDeviceGetTotalEnergyConsumption (mJ)
  nvmlReturn_t (*power)(nvmlDevice_t, unsigned*) = nullptr;             // nvmlDeviceGetPowerUsage (mW)
  const char* (*error_string)(nvmlReturn_t) = nullptr;                  // nvmlErrorString

  std::string error(const char* call, nvmlReturn_t rc) const {
    return str_cat(call, " failed: ", error_string ? error_string(rc) : "unknown error", " (NVML error ", rc, ")");
  }
  ~Nvml() {
    if (initialised) shutdown();
    if (lib) dlclose(lib);
  }
};

const char* energy_source_name(EnergySource s) {
  switch (s) {
    case EnergySource::Counter: return "nvml energy counter";
    case EnergySource::PowerSamples: return "nvml power samples";
    case EnergySource::None: break;
  }
  return "none";
}

namespace {
// Looks up `name` in `lib` into `fn`; false (and the loader's message in `why`) when absent.
template <typename F>
bool symbol(void* lib, const char* name, F& fn, std::string& why) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn) why = str_cat("NVML has no ", name);
  return fn != nullptr;
}
}  // namespace

EnergyMeter::EnergyMeter(const std::string& library, const std::string& pci_bus_id, Options opts)
    : nvml_(std::make_unique<Nvml>()), opts_(opts) {
  if (open(library, pci_bus_id)) return;
  source_ = EnergySource::None;
  nvml_.reset();  // shuts NVML down and closes the library
}

bool EnergyMeter::open(const std::string& library, const std::string& pci_bus_id) {
  Nvml& n = *nvml_;
  const auto no = [this](std::string why) {
    reason_ = std::move(why);
    return false;
  };
  n.lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!n.lib) {
    const char* e = dlerror();
    // dlerror() starts with the path it tried.
    return no(e ? str_cat("cannot load ", e) : str_cat("cannot load ", library));
  }
  if (!symbol(n.lib, "nvmlInit_v2", n.init, reason_) || !symbol(n.lib, "nvmlShutdown", n.shutdown, reason_) ||
      !symbol(n.lib, "nvmlErrorString", n.error_string, reason_))
    return false;
  // Optional: a library without one of these says so when it is needed.
  std::string unused;
  symbol(n.lib, "nvmlDeviceGetHandleByPciBusId_v2", n.by_bus_id, unused);
  symbol(n.lib, "nvmlDeviceGetHandleByIndex_v2", n.by_index, unused);
  symbol(n.lib, "nvmlDeviceGetTotalEnergyConsumption", n.energy, unused);
  symbol(n.lib, "nvmlDeviceGetPowerUsage", n.power, unused);
  if (nvmlReturn_t rc = n.init(); rc != kNvmlSuccess) return no(n.error("nvmlInit_v2", rc));
  n.initialised = true;
  if (pci_bus_id.empty()) {
    if (!n.by_index) return no("NVML has no nvmlDeviceGetHandleByIndex_v2");
    if (nvmlReturn_t rc = n.by_index(0, &n.device); rc != kNvmlSuccess)
      return no(n.error("nvmlDeviceGetHandleByIndex_v2(0)", rc));
  } else {
    if (!n.by_bus_id) return no("NVML has no nvmlDeviceGetHandleByPciBusId_v2");
    if (nvmlReturn_t rc = n.by_bus_id(pci_bus_id.c_str(), &n.device); rc != kNvmlSuccess)
      return no(n.error(str_cat("nvmlDeviceGetHandleByPciBusId_v2(", pci_bus_id, ")").c_str(), rc));
  }
  // The counter where the device has one (Volta and newer), else the power readings.
  std::string counter_why = "NVML has no nvmlDeviceGetTotalEnergyConsumption";
  if (n.energy) {
    const nvmlReturn_t rc = n.energy(n.device, &start_mj_);
    if (rc == kNvmlSuccess) {
      source_ = EnergySource::Counter;
      return true;
    }
    counter_why = n.error("nvmlDeviceGetTotalEnergyConsumption", rc);
  }
  unsigned mw = 0;
  if (!n.power) return no(str_cat(counter_why, "; NVML has no nvmlDeviceGetPowerUsage"));
  if (nvmlReturn_t rc = n.power(n.device, &mw); rc != kNvmlSuccess)
    return no(str_cat(counter_why, "; ", n.error("nvmlDeviceGetPowerUsage", rc)));
  last_w_ = mw / 1e3;
  last_t_ = now_seconds();
  source_ = EnergySource::PowerSamples;
  sampler_ = std::thread([this] { sample_power(); });
  return true;
}

EnergyMeter::~EnergyMeter() {
  if (sampler_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    sampler_.join();
  }
}

// The trapezoid rule between readings; a failed reading keeps the last power.
void EnergyMeter::sample_power() {
  std::unique_lock<std::mutex> lock(mu_);
  const auto period = std::chrono::duration<double>(opts_.sample_period_s);
  while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
    lock.unlock();
    unsigned mw = 0;
    const bool ok = nvml_->power(nvml_->device, &mw) == kNvmlSuccess;
    const double t = now_seconds();
    lock.lock();
    const double w = ok ? mw / 1e3 : last_w_;
    sampled_j_ += 0.5 * (last_w_ + w) * (t - last_t_);
    last_w_ = w;
    last_t_ = t;
  }
}

std::optional<double> EnergyMeter::joules() {
  switch (source_) {
    case EnergySource::Counter: {
      unsigned long long mj = 0;
      if (nvml_->energy(nvml_->device, &mj) != kNvmlSuccess) return std::nullopt;
      return double(mj - start_mj_) / 1e3;
    }
    case EnergySource::PowerSamples: {
      // Up to the last sample, then the last power held until now.
      std::lock_guard<std::mutex> lock(mu_);
      return sampled_j_ + last_w_ * (now_seconds() - last_t_);
    }
    case EnergySource::None: break;
  }
  return std::nullopt;
}

EnergySpan::EnergySpan(EnergyMeter* meter) : meter_(meter) {
  if (!meter_) return;
  start_s_ = now_seconds();
  start_j_ = meter_->joules();
}

std::optional<StepEnergy> EnergySpan::take(double tokens) const {
  if (!meter_ || !start_j_) return std::nullopt;
  const std::optional<double> end_j = meter_->joules();
  const double seconds = now_seconds() - start_s_;
  if (!end_j || !(seconds > 0) || !(tokens > 0)) return std::nullopt;
  const double j = *end_j - *start_j_;
  return StepEnergy{j, j / tokens, j / seconds};
}

}  // namespace xirang
