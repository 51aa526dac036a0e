// tests/support/clock_probe.h: which part of the step clock is open here.
//
// A pass, a feed or a communication wait under test asks the clock which
// part its time is charged to, the way a tensor-parallel collective inside a
// pass would find out: it lets time pass, opens a part of its own (the
// probe part) and closes it. Opening charges the time since the clock's last
// transition to the innermost open part, so the one part (or the
// unaccounted time) that grew is the enclosing one. The probe part is
// CkptStall, which nothing in a pipeline step opens.
//
//   std::optional<StepPart> p = open_part(ctx.clock);   // StepPart::Forward inside a forward pass
#pragma once

#include <array>
#include <optional>
#include <string>

#include "core/clock.h"
#include "core/step_clock.h"

namespace xirang {

constexpr StepPart kProbePart = StepPart::CkptStall;

// The part open now on `clock`; nullopt when none is (the time is
// unaccounted) or when the clock is null or stopped.
inline std::optional<StepPart> open_part(StepClock* clock) {
  if (!clock || !clock->running()) return std::nullopt;
  std::array<double, kStepParts> before{};
  for (size_t i = 0; i < kStepParts; ++i) before[i] = clock->ms(StepPart(i));
  const double t0 = now_seconds();
  while (now_seconds() <= t0 + 1e-6) {
  }
  clock->open(kProbePart);
  clock->close();
  for (size_t i = 0; i < kStepParts; ++i)
    if (StepPart(i) != kProbePart && clock->ms(StepPart(i)) > before[i]) return StepPart(i);
  return std::nullopt;
}

inline std::string part_name(std::optional<StepPart> p) { return p ? step_part_name(*p) : "unaccounted"; }

}  // namespace xirang
