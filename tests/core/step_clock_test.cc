// core/step_clock.h: every instant of a step charged to the innermost open
// part, or to none; the parts and the unaccounted time add up to the step.
#include "core/step_clock.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/error.h"
#include "tests/support/expect_error.h"

namespace xirang {
namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

double parts_sum(const StepClock& c) {
  double s = 0;
  for (size_t p = 0; p < kStepParts; ++p) s += c.ms(StepPart(p));
  return s;
}

// A collective inside a forward is the collective's, not the forward's; the
// forward resumes after it; time between parts is unaccounted. Sleeps give
// each interval a lower bound; the sum is exact whatever the scheduling.
TEST(StepClock, InnermostPartTakesTheTimeAndThePartsAddUp) {
  StepClock c;
  c.start();
  sleep_ms(5);  // unaccounted
  {
    StepClock::Scope f(&c, StepPart::Forward);
    sleep_ms(5);
    {
      StepClock::Scope t(&c, StepPart::TpComm);
      sleep_ms(20);
    }
    sleep_ms(5);
  }
  c.stop();
  EXPECT_GE(c.unaccounted_ms(), 5);
  EXPECT_GE(c.ms(StepPart::TpComm), 20);
  EXPECT_GE(c.ms(StepPart::Forward), 10);
  EXPECT_NEAR(parts_sum(c) + c.unaccounted_ms(), c.step_ms(), 1e-9);
  EXPECT_EQ(c.ms(StepPart::Backward), 0);
  EXPECT_FALSE(c.running());
}

// stop() closes what is open (and a scope ending after it does nothing);
// start() begins at zero; a null or stopped clock's scopes do nothing.
TEST(StepClock, StopClosesOpenPartsAndStartResets) {
  StepClock c;
  c.start();
  StepClock::Scope b(&c, StepPart::Backward);
  sleep_ms(2);
  c.stop();
  b.end();  // after stop(): nothing to close
  EXPECT_GT(c.ms(StepPart::Backward), 0);
  EXPECT_NEAR(parts_sum(c) + c.unaccounted_ms(), c.step_ms(), 1e-9);
  const double first = c.step_ms();
  { StepClock::Scope s(&c, StepPart::Optimizer); }  // stopped: not charged
  { StepClock::Scope s(nullptr, StepPart::Optimizer); }
  EXPECT_EQ(c.ms(StepPart::Optimizer), 0);
  EXPECT_EQ(c.step_ms(), first);
  c.start();
  EXPECT_EQ(c.ms(StepPart::Backward), 0);
  EXPECT_EQ(c.step_ms(), 0);
  c.stop();
  EXPECT_EQ(c.ms(StepPart::Backward), 0);
}

TEST(StepClock, MisuseIsAnInternalError) {
  StepClock c;
  expect_error([&] { c.open(StepPart::Forward); }, ErrorKind::Internal, {"opened outside a step"});
  c.start();
  expect_error([&] { c.close(); }, ErrorKind::Internal, {"close() without an open part"});
  expect_error(
      [&] {
        for (int i = 0; i < 100; ++i) c.open(StepPart::Forward);
      },
      ErrorKind::Internal, {"nested deeper than"});
  EXPECT_STREQ(step_part_name(StepPart::PpCommExposed), "pp_comm_exposed");
}

}  // namespace
}  // namespace xirang
