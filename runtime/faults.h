// runtime/faults.h: fault injection for the fault tests.
//
// The config's faults.{kind,rank,step} pick one fault on one rank at the
// start of one step (1-based): the rank dies (kill), stops answering
// without dying (hang), or fails its next data-parallel transfer
// (fail_transfer, through the simulated link on the dp channel); or it dies
// halfway through writing its file of the checkpoint of that step
// (kill_in_save), or that write fails there as on a failing disk
// (io_error: EIO). The tests check that the job then ends with a clear
// error, not a hang, and that no checkpoint is damaged. One fault lasts:
// slow_rank makes the rank's compute faults.delay_ms longer in that step
// and every later one (a slow device: the straggler tests). nan_grad writes
// NaN into the rank's reduced gradient in faults.steps steps from that step
// on (a diverging run: the non-finite guard's tests).
//
//   FaultInjector faults(cfg.faults, grid, device);
//   faults.at_step(step + 1);                            // before the step runs
//   m.forward_ms += faults.delay_compute(step + 1);      // inside the step's compute
//   Checkpointer ckpt(..., faults.save_faults(), ...);  // kill_in_save and io_error, as a plain struct
//   if (faults.poisons_gradient(step + 1))                // after the gradient reduction
//     faults.poison_gradient(step + 1, grad, name, stream);
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>

#include "comm/process_grid.h"
#include "core/error.h"
#include "core/tensor.h"
#include "runtime/checkpoint/save_faults.h"
#include "runtime/config/config.h"

namespace xirang {

class FaultInjector {
 public:
  // `grid` must outlive the injector; `device` is where gradients move
  // (fail_transfer fails a simulated MPI link, which a device run does not use).
  FaultInjector(const FaultConfig& faults, ProcessGrid& grid, Device device);
  // Injects kill, hang or fail_transfer when `step` is the configured step
  // on this rank (and announces slow_rank there).
  void at_step(int step);
  // slow_rank: the extra compute time of this rank in `step` (faults.delay_ms
  // on the configured rank from the configured step on; 0 otherwise).
  double compute_delay_ms(int step) const;
  // Sleeps compute_delay_ms(step) (a sleep, not a busy wait, so that it
  // takes no core from the other ranks of an oversubscribed test); returns
  // the milliseconds it took.
  double delay_compute(int step) const;
  // kill_in_save and io_error on this rank: the steps whose checkpoint
  // write dies or fails halfway (the checkpointer injects them).
  SaveFaults save_faults() const;
  // nan_grad: whether this rank poisons its gradient in `step`.
  bool poisons_gradient(int step) const;
  // Writes NaN into element 0 of `grad` (host or device memory; on `stream`,
  // then waits) and says so on stderr, naming the parameter `name`.
  void poison_gradient(int step, const Tensor& grad, const std::string& name, void* stream) const;

 private:
  FaultConfig f_;
  ProcessGrid& grid_;
  Device device_;
  int rank_;  // world rank, read once
};

}  // namespace xirang
