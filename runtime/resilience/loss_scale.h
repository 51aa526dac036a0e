// runtime/resilience/loss_scale.h: fp16 loss scaling, the state that keeps
// a 16-bit run's small gradients from underflowing and backs off when they
// overflow. The step's guard (guards.h) votes on the overflow; the
// checkpointer saves and restores the scale.
//
//   LossScale ls(65536, /*dynamic=*/true, /*growth_interval=*/1000);
//   loss_grad *= ls.scale();     // before backward
//   ls.update(overflow);         // after the vote: halve on overflow, grow after clean steps
#pragma once

namespace xirang {

// Loss scaling for fp16: the loss gradient is multiplied by scale() so that
// small activation gradients survive 16-bit storage; the optimizer divides
// it out. Dynamic (Megatron-LM's scaler): a step whose gradients overflow
// (a non-finite global norm, the same value on every rank) is skipped; the
// scale halves, never below min_scale, on the hysteresis-th overflow since
// it last grew (and on each one after that); after growth_interval clean
// steps in a row it doubles and the hysteresis count starts over. Fixed or
// off (scale 1), update() changes nothing.
class LossScale {
 public:
  LossScale() = default;
  LossScale(double scale, bool dynamic, int growth_interval, double min_scale = 1.0, int hysteresis = 1)
      : scale_(scale),
        dynamic_(dynamic),
        growth_interval_(growth_interval),
        min_scale_(min_scale),
        hysteresis_(hysteresis),
        hysteresis_left_(hysteresis) {}
  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  bool enabled() const { return dynamic_ || scale_ != 1.0; }
  // Whether an overflow can still lower the scale (dynamic, above its minimum).
  bool can_back_off() const { return dynamic_ && scale_ > min_scale_; }
  int good_steps() const { return good_steps_; }
  int hysteresis_left() const { return hysteresis_left_; }
  void update(bool overflow);
  // Checkpoint state.
  void restore(double scale, int good_steps, int hysteresis_left) {
    scale_ = scale;
    good_steps_ = good_steps;
    hysteresis_left_ = hysteresis_left;
  }

 private:
  double scale_ = 1.0;
  bool dynamic_ = false;
  int growth_interval_ = 1000;
  double min_scale_ = 1.0;
  int hysteresis_ = 1;
  int hysteresis_left_ = 1;  // overflows still tolerated before the scale halves
  int good_steps_ = 0;
};

}  // namespace xirang
