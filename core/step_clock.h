// core/step_clock.h: which part of a training step each instant belongs to.
//
// A step is one interval of wall time; the clock cuts it into disjoint
// parts. Opening a part pauses the part that was open (a tensor-parallel
// collective inside a forward pass, a bucket launch inside the backward
// pass's gradient-ready hook, a tied-embedding reduction inside the
// pipeline's drain) and closing it resumes that one, so every instant is
// charged to the innermost open part, or to no part ("unaccounted": the
// step's own bookkeeping between parts). The parts and the unaccounted
// time add up to the step's time by construction: each transition charges
// the time since the previous one, read from one clock.
//
// Code that may run outside a step (evaluation, a test of one layer) holds
// a null clock or one that is not running: scopes then do nothing.
//
//   StepClock clock;
//   clock.start();
//   { StepClock::Scope f(&clock, StepPart::Forward);
//     { StepClock::Scope c(&clock, StepPart::TpComm); ...collective... }   // not forward's
//   }
//   clock.stop();
//   clock.ms(StepPart::Forward) + ... + clock.unaccounted_ms() == clock.step_ms()
#pragma once

#include <array>
#include <cstddef>

namespace xirang {

// docs/metrics.md names them: forward_ms, backward_ms and so on.
enum class StepPart {
  Forward,        // forward passes (and a slowed rank's injected delay)
  Backward,       // backward passes, their recomputation included
  Optimizer,      // gradient norm, the loss-scale vote, the update
  DataWait,       // blocked on the loader and copying a microbatch in
  TpComm,         // tensor-parallel collectives (blocking)
  DpCommExposed,  // data-parallel bucket launches and waits, ZeRO's gather
  PpBubble,       // waiting for a neighbour's activation or gradient, and the pipeline's drain
  PpCommExposed,  // waiting for our own pipeline sends and the tied-embedding reduction
  CkptStall,      // the step stopped to save a checkpoint
  DeviceWait,     // the host waiting for the device's queued passes (their time is the device's)
};
constexpr size_t kStepParts = 10;
const char* step_part_name(StepPart p);

class StepClock {
 public:
  // The step begins now: every part at zero, none open.
  void start();
  // The step ends now; what is still open is closed.
  void stop();
  bool running() const { return running_; }
  // Opens `part` (the open part pauses) until the matching close().
  void open(StepPart part);
  void close();

  // Of the last step (or so far): a part's time, what no part claimed, and the whole.
  double ms(StepPart part) const { return 1e3 * s_[size_t(part)]; }
  double unaccounted_ms() const { return 1e3 * unaccounted_s_; }
  double step_ms() const { return 1e3 * step_s_; }
  // When the step began (now_seconds): with step_ms, the step's span on the same clock.
  double started_at() const { return start_; }

  // A part open for a scope's lifetime; a null or stopped clock does nothing.
  class Scope {
   public:
    Scope(StepClock* clock, StepPart part) : clock_(clock && clock->running() ? clock : nullptr) {
      if (clock_) clock_->open(part);
    }
    ~Scope() { end(); }
    void end() {
      if (clock_) clock_->close();
      clock_ = nullptr;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    StepClock* clock_;
  };

 private:
  // Charges the time since the last transition to the innermost open part.
  void charge(double now);

  static constexpr size_t kDepth = 16;
  std::array<double, kStepParts> s_{};  // seconds per part
  double unaccounted_s_ = 0, step_s_ = 0;
  double start_ = 0, last_ = 0;
  std::array<StepPart, kDepth> open_{};
  size_t depth_ = 0;
  bool running_ = false;
};

}  // namespace xirang
