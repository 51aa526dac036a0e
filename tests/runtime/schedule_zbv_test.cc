// Tests for zb_v (runtime/step/schedule_zbv.h; Qi et al. 2024, ZB-V): two
// chunks per rank in a V, its lists well formed for any m, free of
// deadlock, holding at most 2p chunk-microbatches (p stages' activations,
// p M_B) on each rank, idle only while the last rank waits for its first
// input when F = B = W, and its bubble under unequal times against
// interleaved 1F1B's with the same two chunks per rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "runtime/config/schedule_rules.h"
#include "runtime/step/schedule.h"
#include "tests/runtime/schedule_costs.h"

namespace xirang {
namespace {

constexpr ScheduleKind kV = ScheduleKind::ZeroBubbleV;

std::string label(int p, int m) { return "zb_v p=" + std::to_string(p) + " m=" + std::to_string(m); }

TEST(ZeroBubbleV, PlacementIsAV) {
  for (int p : {2, 3, 4, 8}) {
    std::vector<int> owner(size_t(2 * p), -1);
    for (int rank = 0; rank < p; ++rank)
      for (int chunk : {0, 1}) {
        const int g = chunk_map(kV, p, 2).model_chunk(rank, chunk);
        ASSERT_GE(g, 0);
        ASSERT_LT(g, 2 * p);
        EXPECT_EQ(owner[size_t(g)], -1) << "model chunk " << g << " placed twice";
        owner[size_t(g)] = rank;
      }
    // Rank i holds chunks i and 2p - 1 - i: the first and the last on rank 0.
    for (int g = 0; g < 2 * p; ++g) EXPECT_EQ(owner[size_t(g)], g < p ? g : 2 * p - 1 - g) << "p=" << p;
    EXPECT_EQ(chunk_map(ScheduleKind::Interleaved, p, 2).model_chunk(1, 1), p + 1);  // the others keep c p + r
    // rank_of and local_of invert model_chunk, in both orders (the executor finds its neighbours with them).
    for (ScheduleKind kind : {kV, ScheduleKind::Interleaved}) {
      const ChunkMap map = chunk_map(kind, p, 2);
      for (int rank = 0; rank < p; ++rank)
        for (int chunk : {0, 1}) {
          const int g = map.model_chunk(rank, chunk);
          EXPECT_EQ(map.rank_of(g), rank) << schedule_name(kind) << " p=" << p << " g=" << g;
          EXPECT_EQ(map.local_of(g), chunk) << schedule_name(kind) << " p=" << p << " g=" << g;
        }
    }
  }
}

// Every list, any m: each (local chunk, microbatch) runs Forward,
// BackwardInput and BackwardWeight once in that order, each kind in
// microbatch order per chunk; receives and sends surround them exactly
// where the V has a neighbour (none before model chunk 0's forward or
// after model chunk 2p - 1's, both on rank 0); the simulator finds no
// deadlock; no rank holds more than 2p chunk-microbatches.
TEST(ZeroBubbleV, ListsAreWellFormed) {
  for (int p : {2, 3, 4, 8})
    for (int m = 1; m <= 4 * p; ++m) {
      SCOPED_TRACE(label(p, m));
      const SimResult r = simulate(kV, p, m, 2, fbw(1, 1, 1));
      ASSERT_TRUE(r.ok) << r.error;
      for (int rank = 0; rank < p; ++rank) {
        SCOPED_TRACE("rank " + std::to_string(rank));
        EXPECT_LE(r.peak_in_flight[size_t(rank)], 2 * p);
        EXPECT_EQ(r.peak_in_flight[size_t(rank)], std::min(2 * p, 2 * m));
        const auto list = make_schedule(kV, p, rank, m, 2);
        std::map<std::pair<int, int>, int> stage;  // (chunk, mb) -> 1 forward, 2 input, 3 weight
        int next[3][2] = {{0, 0}, {0, 0}, {0, 0}};
        for (size_t i = 0; i + 2 < list.size(); ++i) {
          const PipeInstr& in = list[i];
          ASSERT_TRUE(in.chunk == 0 || in.chunk == 1);
          EXPECT_NE(in.op, PipeOp::Backward);
          const int g = chunk_map(kV, p, 2).model_chunk(rank, in.chunk);
          int& st = stage[{in.chunk, in.microbatch}];
          const size_t c = size_t(in.chunk);
          if (in.op == PipeOp::Forward) {
            EXPECT_EQ(st++, 0);
            EXPECT_EQ(in.microbatch, next[0][c]++);
            EXPECT_EQ(i > 0 && list[i - 1].op == PipeOp::RecvActivation, g > 0);
            EXPECT_EQ(list[i + 1].op == PipeOp::SendActivation, g < 2 * p - 1);
          }
          if (in.op == PipeOp::BackwardInput) {
            EXPECT_EQ(st++, 1);
            EXPECT_EQ(in.microbatch, next[1][c]++);
            EXPECT_EQ(i > 0 && list[i - 1].op == PipeOp::RecvGradient, g < 2 * p - 1);
            EXPECT_EQ(list[i + 1].op == PipeOp::SendGradient, g > 0);
          }
          if (in.op == PipeOp::BackwardWeight) {
            EXPECT_EQ(st++, 2);
            EXPECT_EQ(in.microbatch, next[2][c]++);
          }
        }
        EXPECT_EQ(stage.size(), size_t(2 * m));
        for (const auto& [key, st] : stage) EXPECT_EQ(st, 3) << "chunk " << key.first << " mb " << key.second;
        EXPECT_EQ(list.back().op, PipeOp::OptimizerStep);
      }
    }
}

// F = B = W per chunk and m >= 2p: rank p - 1 cannot start before p - 1
// chunk forwards have run above it, and then has 6m passes of work; ZB-V
// reaches that bound, so every rank idles exactly (p - 1) chunk forwards,
// (p - 1) F / 2 in stage units: half of zb_h1's (p - 1) F at a stage's
// 1F1B peak of p M_B (2p chunk-microbatches).
TEST(ZeroBubbleV, EqualTimesIdleOnlyWhileTheVFills) {
  for (int p : {2, 3, 4, 8})
    for (int m = 2 * p; m <= 4 * p; ++m) {
      SCOPED_TRACE(label(p, m));
      const double f = 2;  // a chunk's F, B and W are 1
      const SimResult r = simulate(kV, p, m, 2, fbw(f, f, f));
      ASSERT_TRUE(r.ok) << r.error;
      EXPECT_NEAR(r.makespan, (p - 1) * f / 2 + 3 * m * f, 1e-9);
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_NEAR(r.busy[size_t(rank)], 3 * m * f, 1e-9);
        EXPECT_NEAR(r.makespan - r.busy[size_t(rank)], (p - 1) * f / 2, 1e-9) << "rank " << rank;
        EXPECT_EQ(r.peak_in_flight[size_t(rank)], 2 * p) << "rank " << rank;
      }
      EXPECT_NEAR(r.bubble_fraction, analytic_bubble(kV, p, m, 2), 1e-12);
      const SimResult h1 = simulate(ScheduleKind::ZeroBubbleH1, p, m, 1, fbw(f, f, f));
      ASSERT_TRUE(h1.ok) << h1.error;
      EXPECT_NEAR(h1.makespan - r.makespan, (p - 1) * f / 2, 1e-9);
    }
}

// Interleaved 1F1B (v = 2) idles (p - 1)(F + B + W) / 2 at the same two
// chunks per rank; ZB-V's list is found at the times it runs at. At the
// times below it idles less for p in {2, 4, 8} and m in {2p, 4p}. It does
// not everywhere: with B = 2F and W = F (p = 2 and 8), or W well under B
// with p >= 4 and m = 4p (F, B, W = 0.7, 1.3, 0.4), the greedy list idles
// more, and more with m (DISABLED_PrintAgainstInterleaved prints the table,
// docs/pipeline_schedules.md keeps it). Peak memory stays at 2p
// chunk-microbatches whatever the times.
TEST(ZeroBubbleV, UnequalTimesAgainstInterleaved) {
  const double times[][3] = {{1, 1, 1}, {1, 1, 2}, {1, 0.5, 1}, {1, 1.5, 0.5}, {2, 1, 1}};
  for (int p : {2, 4, 8})
    for (int m : {2 * p, 4 * p})
      for (const auto& t : times) {
        const double f = t[0], b = t[1], w = t[2];
        SCOPED_TRACE(label(p, m) + " F=" + std::to_string(f) + " B=" + std::to_string(b) + " W=" + std::to_string(w));
        const SimResult v = simulate(kV, p, m, 2, fbw(f, b, w));
        const SimResult il = simulate(ScheduleKind::Interleaved, p, m, 2, fbw(f, b, w));
        ASSERT_TRUE(v.ok && il.ok) << v.error << il.error;
        for (int rank = 0; rank < p; ++rank) {
          EXPECT_NEAR(v.busy[size_t(rank)], m * (f + b + w), 1e-9);
          EXPECT_LE(v.peak_in_flight[size_t(rank)], 2 * p);
        }
        EXPECT_NEAR(il.makespan - m * (f + b + w), (p - 1) * (f + b + w) / 2, 1e-9);
        EXPECT_LT(v.makespan, il.makespan - 1e-9);
      }
}

// The table for the report:
//   runtime_tests --gtest_also_run_disabled_tests --gtest_filter='*PrintAgainstInterleaved*'
TEST(ZeroBubbleV, DISABLED_PrintAgainstInterleaved) {
  const double times[][3] = {{1, 1, 1},     {1, 1.2, 0.8}, {1, 1.5, 0.5}, {2, 1, 1}, {1, 2, 1},
                             {0.7, 1.3, 0.4}, {1, 1, 0.5},  {1, 1, 2},     {1, 0.5, 1}};
  std::printf("| p | m | F | B | W | zb_v idle | interleaved v=2 idle | zb_h1 idle | zb_h2 idle (flushed) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (int p : {2, 4, 8})
    for (int m : {2 * p, 4 * p})
      for (const auto& t : times) {
        const SimCosts c = fbw(t[0], t[1], t[2]);
        const double busy = m * (t[0] + t[1] + t[2]);
        const SimResult v = simulate(kV, p, m, 2, c), il = simulate(ScheduleKind::Interleaved, p, m, 2, c),
                        h1 = simulate(ScheduleKind::ZeroBubbleH1, p, m, 1, c),
                        h2 = simulate(ScheduleKind::ZeroBubbleH2, p, m, 1, c);
        ASSERT_TRUE(v.ok && il.ok && h1.ok && h2.ok);
        std::printf("| %d | %d | %g | %g | %g | %.3g | %.3g | %.3g | %.3g |\n", p, m, t[0], t[1], t[2],
                    v.makespan - busy, il.makespan - busy, h1.makespan - busy, h2.makespan - busy);
      }
}

TEST(ZeroBubbleV, RulesAndRefusals) {
  EXPECT_THROW(make_schedule(kV, 1, 0, 4, 2), Error);  // one stage
  EXPECT_THROW(make_schedule(kV, 4, 0, 8, 1), Error);  // the V is two chunks per rank
  EXPECT_THROW(make_schedule(kV, 4, 0, 8, 3), Error);
  EXPECT_NO_THROW(make_schedule(kV, 4, 0, 3, 2));       // any m, fewer than p too
  PassTimes zero;
  zero.weight = 0;
  EXPECT_THROW(make_schedule(kV, 4, 0, 8, 2, zero), Error);
}

}  // namespace
}  // namespace xirang
