// core/step_clock.h: every instant of a step charged to the innermost open
// part, or to none; the parts and the unaccounted time add up to the step.
#include "core/step_clock.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

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

// A part that names a span draws it with the clock's own transitions: a
// lone part's span lasts exactly its charged time, a nested part's span lies
// inside the enclosing one's, and the enclosing part's time is its span less
// the nested span. Without tracing nothing is drawn; without a running clock
// the span is still drawn (evaluation outside a step).
TEST(StepClock, PartsDrawTheirSpansAtTheClocksTransitions) {
  Timeline tl;
  tl.set_tracing(true);
  StepClock c;
  c.start();
  {
    StepClock::Scope f(&c, StepPart::Forward, {&tl, "forward", Track::Main, 3, 1});
    sleep_ms(2);
    {
      StepClock::Scope w(&c, StepPart::PpBubble, {&tl, "wait_activation", Track::Main, 4});
      sleep_ms(3);
    }
    sleep_ms(1);
  }
  { StepClock::Scope o(&c, StepPart::Optimizer); }  // no span named
  c.stop();
  EXPECT_EQ(tl.open_spans(), 0);
  const std::vector<Span> spans = tl.take_spans();
  ASSERT_EQ(spans.size(), 2u);
  const Span& inner = spans[0];
  const Span& outer = spans[1];
  EXPECT_STREQ(inner.name, "wait_activation");
  EXPECT_EQ(inner.microbatch, 4);
  EXPECT_STREQ(outer.name, "forward");
  EXPECT_EQ(outer.microbatch, 3);
  EXPECT_EQ(outer.chunk, 1);
  EXPECT_NEAR((inner.t1 - inner.t0) * 1e3, c.ms(StepPart::PpBubble), 1e-9);
  EXPECT_NEAR((outer.t1 - outer.t0 - (inner.t1 - inner.t0)) * 1e3, c.ms(StepPart::Forward), 1e-9);
  EXPECT_GE(inner.t0, outer.t0);
  EXPECT_LE(inner.t1, outer.t1);
  EXPECT_GE(outer.t0, c.started_at());

  tl.set_tracing(false);
  c.start();
  { StepClock::Scope f(&c, StepPart::Forward, {&tl, "forward"}); }
  c.stop();
  EXPECT_TRUE(tl.take_spans().empty());

  tl.set_tracing(true);
  const double last_forward = c.ms(StepPart::Forward);
  { StepClock::Scope e(&c, StepPart::Forward, {&tl, "forward"}); }  // the clock is stopped: charges nothing
  EXPECT_EQ(c.ms(StepPart::Forward), last_forward);
  ASSERT_EQ(tl.take_spans().size(), 1u);
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
