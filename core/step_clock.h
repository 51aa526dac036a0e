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
// A scope that names a trace span (SpanTag) draws the part on the
// timeline as well (core/timeline.h, when it is tracing): the span's ends
// are the clock's own transitions, so the trace shows exactly the time the
// part was charged.
//
// On a device the clock also owns the step's one pool of timing events
// (core/device_events.h): the passes, the dp joins' waits and the per-op
// profile record their event pairs from it.
//
// Code that may run outside a step (evaluation, a test of one layer) holds
// a null clock or one that is not running: scopes then charge nothing (a
// span is still drawn, on the steady clock).
//
//   StepClock clock;
//   clock.start();
//   { StepClock::Scope f(&clock, StepPart::Forward, {tl, "forward"});
//     { StepClock::Scope c(&clock, StepPart::TpComm); ...collective... }   // not forward's
//   }
//   clock.stop();
//   clock.ms(StepPart::Forward) + ... + clock.unaccounted_ms() == clock.step_ms()
#pragma once

#include <array>
#include <cstddef>

#include "core/device_events.h"
#include "core/timeline.h"

namespace xirang {

// docs/metrics.md names them: forward_ms, backward_ms and so on.
enum class StepPart {
  Forward,        // forward passes (and a slowed rank's injected delay)
  Backward,       // backward passes, their recomputation included
  Optimizer,      // gradient norm, the loss-scale vote, the update
  DataWait,       // blocked on the loader and copying a microbatch in
  TpComm,         // tensor-parallel collectives (blocking)
  CpComm,         // context-parallel key/value all-gathers and their gradients' reduce-scatters (blocking)
  DpCommExposed,  // data-parallel bucket launches and waits, ZeRO's gather
  PpBubble,       // waiting for a neighbour's activation or gradient, and the pipeline's drain
  PpCommExposed,  // waiting for our own pipeline sends and the tied-embedding reduction
  CkptStall,      // the step stopped to save a checkpoint
  DeviceWait,     // the host waiting for the device's queued passes (their time is the device's)
};
constexpr size_t kStepParts = 11;
const char* step_part_name(StepPart p);

// The trace span a part draws: none when `tl` is null or not tracing.
struct SpanTag {
  Timeline* tl = nullptr;
  const char* name = "";  // a literal
  Track track = Track::Main;
  int microbatch = -1, chunk = -1, index = -1;
};

class StepClock {
 public:
  // The step begins now: every part at zero, none open.
  void start();
  // The step ends now; what is still open is closed.
  void stop();
  bool running() const { return running_; }
  // Opens `part` (the open part pauses) until the matching close(). Both
  // return the instant of the transition (now_seconds()).
  double open(StepPart part);
  double close();

  // Of the last step (or so far): a part's time, what no part claimed, and the whole.
  double ms(StepPart part) const { return 1e3 * s_[size_t(part)]; }
  double unaccounted_ms() const { return 1e3 * unaccounted_s_; }
  double step_ms() const { return 1e3 * step_s_; }
  // When the step began (now_seconds): with step_ms, the step's span on the same clock.
  double started_at() const { return start_; }
  // The step's device timing events (CUDA builds; see core/device_events.h).
  DeviceEvents& device_events() { return events_; }

  // A part open for a scope's lifetime, and its span; a null or stopped
  // clock charges nothing.
  class Scope {
   public:
    Scope(StepClock* clock, StepPart part, const SpanTag& span = {})
        : clock_(clock && clock->running() ? clock : nullptr), tl_(span.tl && span.tl->tracing() ? span.tl : nullptr) {
      const double t = clock_ ? clock_->open(part) : tl_ ? now_seconds() : 0;
      if (tl_) {
        span_ = Span{span.name, span.track, span.microbatch, span.chunk, span.index, -1, t, t};
        tl_->span_opened();
      }
    }
    ~Scope() { end(); }
    // Ends the part (and its span) before the scope does.
    void end() {
      const double t = clock_ ? clock_->close() : tl_ ? now_seconds() : 0;
      if (tl_) {
        span_.t1 = t;
        tl_->add_span(span_);
        tl_->span_closed();
      }
      clock_ = nullptr;
      tl_ = nullptr;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    StepClock* clock_;
    Timeline* tl_;
    Span span_;
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
  DeviceEvents events_;
};

}  // namespace xirang
