#include "runtime/resilience/loss_scale.h"

#include <algorithm>

namespace xirang {

void LossScale::update(bool overflow) {
  if (!dynamic_) return;
  if (overflow) {
    good_steps_ = 0;
    if (--hysteresis_left_ <= 0) {
      scale_ = std::max(min_scale_, scale_ * 0.5);
      hysteresis_left_ = 0;  // every further overflow halves until the scale grows again
    }
  } else if (++good_steps_ >= growth_interval_) {
    scale_ *= 2.0;
    good_steps_ = 0;
    hysteresis_left_ = hysteresis_;
  }
}

}  // namespace xirang
