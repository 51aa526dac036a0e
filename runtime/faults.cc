#include "runtime/faults.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <limits>
#include <cstdio>
#include <thread>
#include <vector>

#include "comm/simulated_link.h"
#include "core/clock.h"
#include "core/device_memory.h"
#include "core/error.h"

namespace xirang {

FaultInjector::FaultInjector(const FaultConfig& faults, ProcessGrid& grid, Device device)
    : f_(faults), grid_(grid), device_(device), rank_(grid.world_rank()) {}

void FaultInjector::at_step(int step) {
  if (f_.kind == FaultKind::None || f_.kind == FaultKind::KillInSave || f_.kind == FaultKind::NanGrad ||
      f_.kind == FaultKind::IoError ||
      f_.step != step || f_.rank != rank_)
    return;
  std::fprintf(stderr, "rank %d: injecting fault '%s' at step %d%s\n", f_.rank, config_name(f_.kind), step,
               f_.kind == FaultKind::SlowRank ? str_cat(" (", f_.delay_ms, " ms more compute from now on)").c_str() : "");
  std::fflush(stderr);
  if (f_.kind == FaultKind::Kill) std::raise(SIGKILL);
  if (f_.kind == FaultKind::Hang)
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // a peer that stops answering
  if (f_.kind == FaultKind::FailTransfer) {
    if (device_ != Device::CPU)
      fail(ErrorKind::Config, "faults.kind=fail_transfer fails the simulated MPI link of the dp channel; "
                              "device.backend=cuda moves gradients over NCCL");
    auto* link = dynamic_cast<SimulatedLink*>(&grid_.dp_grads());
    if (!link) fail(ErrorKind::Config, "faults.kind=fail_transfer needs the simulated link on the dp channel");
    link->fail_next(1);
  }
}

double FaultInjector::compute_delay_ms(int step) const {
  return f_.kind == FaultKind::SlowRank && f_.rank == rank_ && step >= f_.step ? f_.delay_ms : 0.0;
}

double FaultInjector::delay_compute(int step) const {
  const double ms = compute_delay_ms(step);
  if (ms <= 0) return 0;
  Stopwatch sw;
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
  return sw.ms();
}

SaveFaults FaultInjector::save_faults() const {
  SaveFaults f;
  f.rank = rank_;
  if (f_.rank != rank_) return f;
  if (f_.kind == FaultKind::KillInSave) f.kill_step = f_.step;
  if (f_.kind == FaultKind::IoError) f.io_error_step = f_.step;
  return f;
}

bool FaultInjector::poisons_gradient(int step) const {
  return f_.kind == FaultKind::NanGrad && f_.rank == rank_ && step >= f_.step && step < f_.step + f_.steps;
}

void FaultInjector::poison_gradient(int step, const Tensor& grad, const std::string& name, void* stream) const {
  XR_CHECK(grad.numel() > 0 && is_float(grad.dtype()), "nan_grad needs a float gradient, got ", grad.str());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  unsigned char bytes[8] = {};
  if (grad.dtype() == DType::F32) std::memcpy(bytes, &nan, 4);
  else if (grad.dtype() == DType::F64) {
    const double d = nan;
    std::memcpy(bytes, &d, 8);
  } else {
    const uint16_t b = grad.dtype() == DType::BF16 ? float_to_bf16(nan).bits : float_to_f16(nan).bits;
    std::memcpy(bytes, &b, 2);
  }
  copy_bytes(grad.raw(), grad.device(), bytes, Device::CPU, dtype_size(grad.dtype()), stream, true);
  std::fprintf(stderr, "rank %d: injecting fault 'nan_grad' at step %d (the gradient of '%s')\n", rank_, step,
               name.c_str());
  std::fflush(stderr);
}

}  // namespace xirang
