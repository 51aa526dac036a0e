// Tests for runtime/step/schedule's zb_h2 (Qi et al. 2024, ZB-H2): its lists
// are well formed for any m, the simulator runs them without deadlock, each
// stage holds 2p - 1 microbatches at most, and the bubble is the paper's
// Table 2 (p - 1)(F + B - 2W) when steps follow each other without the
// optimizer's flush, under the conditions written next to each check.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "runtime/step/schedule.h"
#include "tests/runtime/schedule_costs.h"

namespace xirang {
namespace {

constexpr ScheduleKind kH2 = ScheduleKind::ZeroBubbleH2;

std::string label(int p, int m) { return "zb_h2 p=" + std::to_string(p) + " m=" + std::to_string(m); }

// Rank r's idle per step when steps overlap without a flush: the longest
// rank's span sets the period (schedule.h, SimResult::span).
double unflushed_idle(const SimResult& r, int rank) {
  return *std::max_element(r.span.begin(), r.span.end()) - r.busy[size_t(rank)];
}

// Qi et al. 2024, Table 2: ZB-H2 idles (p - 1)(F + B - 2W) per stage at
// 2p - 1 microbatches in flight. Exact here when m >= 2p - 1 (the warm-up
// is whole), W <= F and 2W <= F + B (the formula is not negative); a grid
// of F, B, W in {0.25 .. 3} showed it exact where both hold and only
// there, and ClosedFormNeedsWNoLongerThanF checks that each is needed. With the step's flush the last stage's first forward
// waits (p - 1) F regardless, so the flushed idle is (p - 1) max(F, F + B - 2W).
// Written out here, not read from bubble_time(), so that both are checked.
TEST(ZeroBubbleH2, TableTwoBubbleWithoutTheFlush) {
  const double times[][3] = {{1, 1, 1},     {1, 1.2, 0.8}, {1, 1.5, 0.5}, {2, 1, 1},     {1, 2, 1},
                             {0.7, 1.3, 0.4}, {1.5, 1, 0.5}, {1, 1, 0.25}, {1.25, 0.75, 0.5},
                             {2, 0.5, 1},    {1, 0.5, 0.75}};  // the last two: W > B is allowed
  for (int p : {2, 3, 4, 8})
    for (int m = 2 * p - 1; m <= 4 * p; ++m)
      for (const auto& t : times) {
        const double f = t[0], b = t[1], w = t[2];
        SCOPED_TRACE(label(p, m) + " F=" + std::to_string(f) + " B=" + std::to_string(b) + " W=" + std::to_string(w));
        const SimResult r = simulate(kH2, p, m, 1, fbw(f, b, w));
        ASSERT_TRUE(r.ok) << r.error;
        const double idle = (p - 1) * (f + b - 2 * w), flushed = (p - 1) * std::max(f, f + b - 2 * w);
        EXPECT_NEAR(bubble_time(kH2, p, f, b, w), idle, 1e-12);
        ASSERT_EQ(r.span.size(), size_t(p));
        for (int rank = 0; rank < p; ++rank) {
          EXPECT_NEAR(r.busy[size_t(rank)], m * (f + b + w), 1e-9);
          EXPECT_NEAR(unflushed_idle(r, rank), idle, 1e-9) << "rank " << rank;
          EXPECT_NEAR(r.makespan - r.busy[size_t(rank)], flushed, 1e-9) << "rank " << rank;
          // Forward to weight part: 2p - 1 on every stage, ZB-H2's 2p - 1 M_B.
          EXPECT_EQ(r.peak_in_flight[size_t(rank)], 2 * p - 1) << "rank " << rank;
          EXPECT_EQ(max_in_flight(make_schedule(kH2, p, rank, m, 1), 1), 2 * p - 1);
        }
        // Never worse than zb_h1 (flushed), which holds p.
        const SimResult h1 = simulate(ScheduleKind::ZeroBubbleH1, p, m, 1, fbw(f, b, w));
        ASSERT_TRUE(h1.ok) << h1.error;
        EXPECT_LE(r.makespan, h1.makespan + 1e-9);
      }
  // Equal F, B and W: no bubble without the flush; with it, ZB-H1's fraction.
  const SimResult r = simulate(kH2, 4, 12, 1, fbw(1, 1, 1));
  for (int rank = 0; rank < 4; ++rank) EXPECT_NEAR(unflushed_idle(r, rank), 0, 1e-12);
  EXPECT_NEAR(r.bubble_fraction, analytic_bubble(kH2, 4, 12, 1), 1e-12);
  EXPECT_NEAR(r.bubble_fraction, 3.0 / (3 * 12 + 3), 1e-12);
}

// Outside the conditions the closed form breaks: W > F (even with 2W <=
// F + B) or 2W > F + B (even with W <= F) leaves idle the formula does not
// count, and bubble_time() refuses to answer.
TEST(ZeroBubbleH2, ClosedFormNeedsWNoLongerThanF) {
  const double times[][3] = {{1, 1, 1.5}, {0.5, 2, 1}, {2, 0.25, 1.5}};
  for (const auto& t : times) {
    const double f = t[0], b = t[1], w = t[2];
    SCOPED_TRACE("F=" + std::to_string(f) + " B=" + std::to_string(b) + " W=" + std::to_string(w));
    const SimResult r = simulate(kH2, 4, 12, 1, fbw(f, b, w));
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_GT(unflushed_idle(r, 0), 3 * (f + b - 2 * w) + 1e-6);
    EXPECT_THROW(bubble_time(kH2, 4, f, b, w), Error);
  }
}

// Every list, any m (fewer than 2p - 1 too): each microbatch has its
// forward, input part and weight part once, in that order; input parts and
// weight parts in microbatch order (the executor marks the gradients final
// at microbatch m - 1's); 2 (p - r - 1) + 1 forwards lead on rank r; the
// simulator finds no deadlock or broken dependency.
TEST(ZeroBubbleH2, ListsAreWellFormed) {
  for (int p : {2, 3, 4, 8})
    for (int m = 1; m <= 4 * p; ++m) {
      SCOPED_TRACE(label(p, m));
      const SimResult r = simulate(kH2, p, m, 1, fbw(1, 1, 1));
      ASSERT_TRUE(r.ok) << r.error;
      for (int rank = 0; rank < p; ++rank) {
        SCOPED_TRACE("rank " + std::to_string(rank));
        const auto list = make_schedule(kH2, p, rank, m, 1);
        std::vector<int> stage(size_t(m), 0);  // 0 none, 1 forward, 2 input, 3 weight
        int next_input = 0, next_weight = 0, leading = 0;
        bool backward_seen = false;
        for (size_t i = 0; i < list.size(); ++i) {
          const PipeInstr& in = list[i];
          EXPECT_NE(in.op, PipeOp::Backward);
          if (in.microbatch < 0) continue;
          int& st = stage[size_t(in.microbatch)];
          if (in.op == PipeOp::Forward) {
            EXPECT_EQ(st++, 0);
            leading += !backward_seen;
          }
          if (in.op == PipeOp::BackwardInput) {
            backward_seen = true;
            EXPECT_EQ(st++, 1);
            EXPECT_EQ(in.microbatch, next_input++);
            EXPECT_EQ(list[i - 1].op == PipeOp::RecvGradient, rank < p - 1);
            EXPECT_EQ(list[i + 1].op == PipeOp::SendGradient, rank > 0);
          }
          if (in.op == PipeOp::BackwardWeight) {
            EXPECT_EQ(st++, 2);
            EXPECT_EQ(in.microbatch, next_weight++);
          }
        }
        for (int mb = 0; mb < m; ++mb) EXPECT_EQ(stage[size_t(mb)], 3) << "microbatch " << mb;
        EXPECT_EQ(leading, std::min(2 * (p - rank - 1) + 1, m));
        EXPECT_EQ(list.back().op, PipeOp::OptimizerStep);
      }
    }
}

// The pools the executor sizes from the list (slot_counts): activations from
// the forward to B, 2 (p - r) - 1 on rank r (the warm-up); layer inputs from
// the forward to W, 2p - 1; W's operands from B to W, 2r + 1 (the lag).
TEST(ZeroBubbleH2, SlotCountsFollowTheWarmUpAndTheLag) {
  for (int p : {2, 3, 4, 8})
    for (int m = 1; m <= 4 * p; ++m)
      for (int rank = 0; rank < p; ++rank) {
        SCOPED_TRACE(label(p, m) + " rank " + std::to_string(rank));
        const SlotCounts s = slot_counts(make_schedule(kH2, p, rank, m, 1), 1, 2);
        EXPECT_EQ(s.activation, std::min(2 * (p - rank) - 1, m) + 2);
        EXPECT_EQ(s.input, std::min(2 * p - 1, m));
        EXPECT_EQ(s.weight, std::min(2 * rank + 1, m));
      }
}

TEST(ZeroBubbleH2, NeedsTwoStages) {
  for (int m : {1, 4}) EXPECT_THROW(make_schedule(kH2, 1, 0, m, 1), Error);
  EXPECT_THROW(make_schedule(kH2, 2, 0, 4, 2), Error);  // virtual stages are interleaved's
}

}  // namespace
}  // namespace xirang
