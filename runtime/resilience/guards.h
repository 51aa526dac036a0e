// runtime/resilience/guards.h: what keeps a long run's state sound: the
// finiteness scan, errors every rank agrees on, the loss-spike window, and
// the step's guard that decides, with every rank, whether an update is
// skipped (runtime/faults.h injects the faults these guard against).
//
//   StepGuard guard(cfg.train, grid.world(), loss_scale, is_logger, hooks);
//   const StepGuard::Verdict v = guard.vote(step, grad_norm, local_loss, stop_vote);
//   if (!v.skip) update();   // v.extra: the world's max of the extra vote (a stop signal)
#pragma once

#include <deque>
#include <optional>
#include <functional>
#include <string>
#include <utility>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/tensor.h"
#include "runtime/config/config.h"
#include "runtime/resilience/loss_scale.h"

namespace xirang {

// Whether every element of `t` (a float tensor, host or device memory; a
// device copy goes through the host on `stream`) is finite. The non-finite
// guard scans gradients with it, the checkpointer the tensors it saves.
bool all_finite(const Tensor& t, void* stream = nullptr);

// The text of the lowest world rank with `have` set, on every rank
// (collective over `world`; up to 1000 characters), with that rank; rank
// -1 and "" when no rank has one. Errors found on some ranks become one
// message that every rank reports alike.
std::pair<int, std::string> lowest_rank_text(Communicator& world, bool have, const std::string& text);

// An error every rank throws alike, after agreeing on it (lowest_rank_text):
// under mpirun rank 0 alone reports it, as for config and data errors.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// train.skip_loss_spikes_zscore: a loss more than `z` standard deviations
// above the mean of the last `window` losses (once `warmup` are known) is a
// spike. Every loss joins the window, spikes too, so that a lasting change of
// level is absorbed instead of skipped for ever.
//
//   LossSpikeGuard guard(3.0);
//   if (guard.spike(loss)) ...  // skip the update
class LossSpikeGuard {
 public:
  explicit LossSpikeGuard(double z, size_t window = 128, size_t warmup = 16)
      : z_(z), window_(window), warmup_(warmup) {}
  // Whether `loss` is a spike against the losses before it; then adds it.
  bool spike(double loss);
  // The mean and standard deviation the last spike() compared with, over `compared()` losses.
  double mean() const { return mean_; }
  double stddev() const { return sd_; }
  size_t compared() const { return n_; }

 private:
  double z_;
  size_t window_, warmup_;
  std::deque<double> losses_;
  double mean_ = 0, sd_ = 0;
  size_t n_ = 0;
};

// The step's guard. One vote over the world on every step, in every
// precision, so that every rank skips the same steps: a non-finite loss or
// gradient norm anywhere skips the update. Under a dynamic loss scale a
// non-finite gradient is an overflow the scale backs off from: expected, it
// does not count toward train.max_nonfinite_steps until the scale is at
// precision.min_scale (or fixed), where backing off cannot help; a
// non-finite loss always counts. After train.max_nonfinite_steps counted
// skips in a row the run stops with one line naming the first. With
// train.skip_loss_spikes_zscore a finite step whose loss is a spike is
// skipped too. The vote carries one more value, the world's max of which
// the caller gets back (the preemption signal).
class StepGuard {
 public:
  struct Hooks {
    std::function<double(double)> global_loss;  // the job's loss from this rank's (collective)
    std::function<std::string()> bad_gradient;  // this rank's first parameter with a non-finite gradient, or ""
    std::function<void()> before_failing;       // runs before the run stops (a checkpoint save in flight)
  };
  StepGuard(const TrainConfig& train, Communicator& world, LossScale& scale, bool logger, Hooks hooks);
  struct Verdict {
    bool skip = false;
    double extra = 0;  // the world's max of `extra`
  };
  // Collective over the world: every rank calls it once per step.
  Verdict vote(int step, double grad_norm, double local_loss, double extra);

 private:
  bool loss_spike(int step, double local_loss);
  std::string nonfinite_cause(bool local_loss_bad, bool local_norm_bad, bool any_loss_bad);

  const TrainConfig& train_;
  Communicator& world_;
  LossScale& scale_;
  bool logger_;
  Hooks hooks_;
  int nonfinite_run_ = 0;        // counted non-finite skips in a row
  std::string nonfinite_first_;  // the first one's step and cause
  std::optional<LossSpikeGuard> spike_guard_;
};

}  // namespace xirang
