#include "core/step_clock.h"

#include "core/clock.h"
#include "core/error.h"

namespace xirang {

const char* step_part_name(StepPart p) {
  static constexpr const char* kNames[kStepParts] = {"forward",         "backward",  "optimizer",       "data_wait",
                                                     "tp_comm",         "cp_comm",         "dp_comm_exposed", "pp_bubble",
                                                     "pp_comm_exposed", "ckpt_stall", "device_wait"};
  return kNames[size_t(p)];
}

void StepClock::start() {
  s_.fill(0);
  unaccounted_s_ = step_s_ = 0;
  depth_ = 0;
  start_ = last_ = now_seconds();
  running_ = true;
}

void StepClock::charge(double now) {
  const double dt = now - last_;
  if (depth_ == 0) unaccounted_s_ += dt;
  else s_[size_t(open_[depth_ - 1])] += dt;
  last_ = now;
  step_s_ = now - start_;
}

void StepClock::stop() {
  if (!running_) return;
  charge(now_seconds());
  depth_ = 0;
  running_ = false;
}

double StepClock::open(StepPart part) {
  XR_CHECK(running_, "StepClock: ", step_part_name(part), " opened outside a step");
  XR_CHECK(depth_ < kDepth, "StepClock: parts nested deeper than ", kDepth);
  const double now = now_seconds();
  charge(now);
  open_[depth_++] = part;
  return now;
}

double StepClock::close() {
  const double now = now_seconds();
  if (!running_) return now;  // stop() closed it
  XR_CHECK(depth_ > 0, "StepClock: close() without an open part");
  charge(now);
  --depth_;
  return now;
}

}  // namespace xirang
