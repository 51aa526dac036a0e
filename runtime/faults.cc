#include "runtime/faults.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "comm/simulated_link.h"
#include "core/clock.h"
#include "core/error.h"

namespace xirang {

FaultInjector::FaultInjector(const FaultConfig& faults, ProcessGrid& grid, Device device)
    : f_(faults), grid_(grid), device_(device), rank_(grid.world_rank()) {}

void FaultInjector::at_step(int step) {
  if (f_.kind == FaultKind::None || f_.kind == FaultKind::KillInSave || f_.step != step || f_.rank != rank_) return;
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

bool FaultInjector::kills_save(int64_t steps_done) const {
  return f_.kind == FaultKind::KillInSave && f_.step == steps_done && f_.rank == rank_;
}

void FaultInjector::kill_in_save(int64_t steps_done) const {
  std::fprintf(stderr, "rank %d: injecting fault 'kill_in_save' at step %lld\n", rank_, (long long)steps_done);
  std::fflush(stderr);
  std::raise(SIGKILL);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // SIGKILL is never ignored; this keeps [[noreturn]] true
}

}  // namespace xirang
