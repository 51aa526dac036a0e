// tests/runtime/schedule_costs.h: pass times for the simulator tests of the
// split-backward schedules (schedule_test.cc, schedule_zb_h2_test.cc,
// schedule_zbv_test.cc).
#pragma once

#include "runtime/step/schedule.h"

namespace xirang {

// Stage times F, B, W per microbatch: the split backward's W is its weight
// share (a chunk of a two-chunk schedule costs half of each).
inline SimCosts fbw(double f, double b, double w) {
  SimCosts c;
  c.forward = f;
  c.backward = b + w;
  c.weight_share = w / (b + w);
  return c;
}

}  // namespace xirang
