// Tests for runtime/schedule: every instruction list of GPipe, 1F1B, ZB-H1 and
// interleaved 1F1B is well formed, the simulator runs them without deadlock at
// the bubble the analysis predicts, 1F1B bounds activations in flight, and
// unsupported combinations are Config errors that name the key.
#include "runtime/config/schedule_rules.h"
#include "runtime/step/schedule.h"
#include "tests/runtime/schedule_costs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace xirang {
namespace {

constexpr ScheduleKind kAllKinds[] = {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved};

// "(kind, p, m, v)" for SCOPED_TRACE, so a failure names its case.
std::string label(ScheduleKind kind, int p, int m, int v) {
  return std::string(schedule_name(kind)) + " p=" + std::to_string(p) + " m=" + std::to_string(m) +
         " v=" + std::to_string(v);
}

// One supported combination; `v` is 1 except for interleaved.
struct Case {
  ScheduleKind kind;
  int p, m, v;
  std::string str() const { return label(kind, p, m, v); }
};

// Every supported (kind, p, m, v) with p in `ps`, m in 1..16, and v in 2..4
// for interleaved (which needs m % p == 0).
std::vector<Case> supported_cases(std::vector<int> ps) {
  std::vector<Case> out;
  for (ScheduleKind kind : kAllKinds)
    for (int p : ps)
      for (int m = 1; m <= 16; ++m) {
        if (kind != ScheduleKind::Interleaved) {
          out.push_back({kind, p, m, 1});
        } else if (m % p == 0) {
          for (int v : {2, 3, 4}) out.push_back({kind, p, m, v});
        }
      }
  return out;
}

// The bubble fraction derived in docs/pipeline_schedules.md, written out here
// rather than read from analytic_bubble() so that both are checked.
double expected_bubble(const Case& c) {
  const double vm = c.kind == ScheduleKind::Interleaved ? double(c.v) * c.m : double(c.m);
  return double(c.p - 1) / (vm + c.p - 1);
}

// Equal stages: every rank costs f forward and b backward per microbatch.
// (A designated initializer would trip -Wmissing-field-initializers on the
// per-rank vectors.)
SimCosts equal_costs(double f, double b, double transfer = 0) {
  SimCosts c;
  c.forward = f;
  c.backward = b;
  c.transfer = transfer;
  return c;
}

// Microbatch-chunks whose activations are live at once, summed over chunks
// (simulate()'s peak_in_flight counts this way; max_in_flight() takes the
// largest single chunk instead).
int peak_live_all_chunks(const std::vector<PipeInstr>& list) {
  int live = 0, peak = 0;
  for (const PipeInstr& in : list) {
    if (in.op == PipeOp::Forward) peak = std::max(peak, ++live);
    if (in.op == PipeOp::Backward || in.op == PipeOp::BackwardWeight) --live;
  }
  return peak;
}

// ---------------------------------------------------------------- bubble

TEST(ScheduleBubble, SimulatedBubbleMatchesAnalysisWithEqualStages) {
  const std::pair<double, double> ratios[] = {{1, 1}, {1, 2}, {1, 3}, {2, 1}};  // forward : backward
  for (const Case& c : supported_cases({2, 4, 8})) {
    for (auto [f, b] : ratios) {
      SCOPED_TRACE(c.str() + " f=" + std::to_string(f) + " b=" + std::to_string(b));
      const SimResult r = simulate(c.kind, c.p, c.m, c.v, equal_costs(f, b, 0));
      ASSERT_TRUE(r.ok) << r.error;
      EXPECT_NEAR(r.bubble_fraction, expected_bubble(c), 1e-12);
      EXPECT_NEAR(analytic_bubble(c.kind, c.p, c.m, c.v), expected_bubble(c), 1e-15);
      // Fill and drain cost (p - 1)(f + b) / v on top of the m (f + b) of work.
      const double fill_drain = double(c.p - 1) * (f + b) / c.v;
      EXPECT_NEAR(r.makespan, c.m * (f + b) + fill_drain, 1e-9);
      ASSERT_EQ(r.busy.size(), size_t(c.p));
      for (int rank = 0; rank < c.p; ++rank) EXPECT_NEAR(r.busy[size_t(rank)], c.m * (f + b), 1e-9) << "rank " << rank;
    }
  }
}

TEST(ScheduleBubble, SinglePipelineStageHasNoBubble) {
  for (const Case& c : supported_cases({1})) {
    SCOPED_TRACE(c.str());
    const SimResult r = simulate(c.kind, c.p, c.m, c.v, equal_costs(1, 2));
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_NEAR(r.bubble_fraction, 0.0, 1e-12);
    EXPECT_NEAR(r.makespan, 3.0 * c.m, 1e-9);
  }
}

// The numbers in docs/pipeline_schedules.md's table: p = 4, f = 1, b = 2, transfer 0.
TEST(ScheduleBubble, GoldenTableForFourStages) {
  struct Row {
    ScheduleKind kind;
    int v, m;
    double makespan, bubble;
    std::vector<int> peak;  // per rank
  };
  using K = ScheduleKind;
  const Row rows[] = {
      {K::GPipe, 1, 4, 21, 3.0 / 7, {4, 4, 4, 4}},
      {K::GPipe, 1, 8, 33, 3.0 / 11, {8, 8, 8, 8}},
      {K::GPipe, 1, 16, 57, 3.0 / 19, {16, 16, 16, 16}},
      {K::OneFOneB, 1, 4, 21, 3.0 / 7, {4, 3, 2, 1}},
      {K::OneFOneB, 1, 8, 33, 3.0 / 11, {4, 3, 2, 1}},
      {K::OneFOneB, 1, 16, 57, 3.0 / 19, {4, 3, 2, 1}},
      {K::Interleaved, 2, 4, 16.5, 3.0 / 11, {8, 8, 8, 8}},  // m == p: all warm-up
      {K::Interleaved, 2, 8, 28.5, 3.0 / 19, {11, 9, 7, 5}},
      {K::Interleaved, 2, 16, 52.5, 3.0 / 35, {11, 9, 7, 5}},
      {K::Interleaved, 4, 4, 14.25, 3.0 / 19, {16, 16, 16, 16}},
      {K::Interleaved, 4, 8, 26.25, 3.0 / 35, {19, 17, 15, 13}},
      {K::Interleaved, 4, 16, 50.25, 3.0 / 67, {19, 17, 15, 13}},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(label(row.kind, 4, row.m, row.v));
    const SimResult r = simulate(row.kind, 4, row.m, row.v, equal_costs(1, 2));
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_NEAR(r.makespan, row.makespan, 1e-9);
    EXPECT_NEAR(r.bubble_fraction, row.bubble, 1e-12);
    EXPECT_EQ(r.peak_in_flight, row.peak);
  }
}

// Prints the table for the docs:
//   runtime_tests --gtest_also_run_disabled_tests --gtest_filter='*PrintBubbleTable*'
TEST(ScheduleBubble, DISABLED_PrintBubbleTable) {
  std::printf("| schedule | v | m | makespan | bubble (sim) | (p-1)/(vm+p-1) | peak in flight, rank 0..3 |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  const std::pair<ScheduleKind, int> kinds[] = {{ScheduleKind::GPipe, 1},
                                                {ScheduleKind::OneFOneB, 1},
                                                {ScheduleKind::Interleaved, 2},
                                                {ScheduleKind::Interleaved, 4}};
  for (auto [kind, v] : kinds)
    for (int m : {4, 8, 16}) {
      const SimResult r = simulate(kind, 4, m, v, equal_costs(1, 2));
      ASSERT_TRUE(r.ok) << r.error;
      std::printf("| %s | %d | %d | %g | %.4f | %.4f | %d %d %d %d |\n", schedule_name(kind), v, m, r.makespan,
                  r.bubble_fraction, analytic_bubble(kind, 4, m, v), r.peak_in_flight[0], r.peak_in_flight[1],
                  r.peak_in_flight[2], r.peak_in_flight[3]);
    }
}

// ---------------------------------------------------------------- memory

TEST(ScheduleMemory, OneFOneBBoundsActivationsInFlightGPipeDoesNot) {
  for (int p : {2, 4, 8})
    for (int m = 1; m <= 16; ++m) {
      const SimResult fb = simulate(ScheduleKind::OneFOneB, p, m, 1, {});
      const SimResult gp = simulate(ScheduleKind::GPipe, p, m, 1, {});
      ASSERT_TRUE(fb.ok && gp.ok) << fb.error << gp.error;
      for (int rank = 0; rank < p; ++rank) {
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) + " rank=" + std::to_string(rank));
        // 1F1B: the warm-up holds p - rank - 1, one more before the first backward.
        const int bound = std::min(p - rank, m);
        EXPECT_EQ(fb.peak_in_flight[size_t(rank)], bound);
        EXPECT_EQ(max_in_flight(make_schedule(ScheduleKind::OneFOneB, p, rank, m, 1), 1), bound);
        EXPECT_LE(fb.peak_in_flight[size_t(rank)], p);
        // GPipe: every forward runs before any backward.
        EXPECT_EQ(gp.peak_in_flight[size_t(rank)], m);
        EXPECT_EQ(max_in_flight(make_schedule(ScheduleKind::GPipe, p, rank, m, 1), 1), m);
      }
    }
}

TEST(ScheduleMemory, SimulatorPeakAgreesWithTheListForInterleaved) {
  for (const Case& c : supported_cases({2, 4, 8})) {
    if (c.kind != ScheduleKind::Interleaved) continue;
    SCOPED_TRACE(c.str());
    const SimResult r = simulate(c.kind, c.p, c.m, c.v, {});
    ASSERT_TRUE(r.ok) << r.error;
    for (int rank = 0; rank < c.p; ++rank) {
      const auto list = make_schedule(c.kind, c.p, rank, c.m, c.v);
      const int per_chunk = max_in_flight(list, c.v);
      EXPECT_EQ(r.peak_in_flight[size_t(rank)], peak_live_all_chunks(list)) << "rank " << rank;
      EXPECT_LE(per_chunk, c.m) << "rank " << rank;
      EXPECT_GE(r.peak_in_flight[size_t(rank)], per_chunk) << "rank " << rank;
      EXPECT_LE(r.peak_in_flight[size_t(rank)], c.v * per_chunk) << "rank " << rank;
    }
  }
}

// ---------------------------------------------------------------- structure

// Checks one rank's list against every rule the executor relies on.
void check_list(const Case& c, int rank, const std::vector<PipeInstr>& list) {
  const int last = c.p * c.v - 1;
  ASSERT_GE(list.size(), 2u);
  // The step ends with the reductions, then the optimizer; neither appears earlier.
  EXPECT_EQ(list[list.size() - 2].op, PipeOp::ReduceGradients);
  EXPECT_EQ(list.back().op, PipeOp::OptimizerStep);
  std::map<std::pair<int, int>, int> fwd_at, bwd_at;  // (chunk, microbatch) -> index
  std::vector<int> last_fwd(size_t(c.v), -1), last_bwd(size_t(c.v), -1);
  auto same = [](const PipeInstr& a, const PipeInstr& b) { return a.microbatch == b.microbatch && a.chunk == b.chunk; };
  for (size_t i = 0; i + 2 < list.size(); ++i) {
    const PipeInstr& in = list[i];
    SCOPED_TRACE("rank " + std::to_string(rank) + " instr " + std::to_string(i) + " " + pipe_op_name(in.op) +
                 " mb " + std::to_string(in.microbatch) + " chunk " + std::to_string(in.chunk));
    ASSERT_NE(in.op, PipeOp::ReduceGradients);
    ASSERT_NE(in.op, PipeOp::OptimizerStep);
    ASSERT_GE(in.chunk, 0);
    ASSERT_LT(in.chunk, c.v);
    ASSERT_GE(in.microbatch, 0);
    ASSERT_LT(in.microbatch, c.m);
    const int g = chunk_map(c.kind, c.p, c.v).model_chunk(rank, in.chunk);
    const PipeInstr* prev = i > 0 ? &list[i - 1] : nullptr;
    const PipeInstr* next = &list[i + 1];
    switch (in.op) {
      case PipeOp::RecvActivation:
        EXPECT_GT(g, 0) << "the first model chunk has no producer";
        EXPECT_TRUE(next->op == PipeOp::Forward && same(*next, in)) << "must feed the next Forward";
        break;
      case PipeOp::SendActivation:
        EXPECT_LT(g, last) << "the last model chunk has no consumer";
        EXPECT_TRUE(prev && prev->op == PipeOp::Forward && same(*prev, in)) << "must follow its Forward";
        break;
      case PipeOp::RecvGradient:
        EXPECT_LT(g, last) << "the last model chunk starts the backward itself";
        EXPECT_TRUE(next->op == PipeOp::Backward && same(*next, in)) << "must feed the next Backward";
        break;
      case PipeOp::SendGradient:
        EXPECT_GT(g, 0) << "the first model chunk has no one to send to";
        EXPECT_TRUE(prev && prev->op == PipeOp::Backward && same(*prev, in)) << "must follow its Backward";
        break;
      case PipeOp::Forward:
        EXPECT_TRUE(fwd_at.emplace(std::pair{in.chunk, in.microbatch}, int(i)).second) << "second Forward";
        EXPECT_GT(in.microbatch, last_fwd[size_t(in.chunk)]) << "forwards out of microbatch order";
        last_fwd[size_t(in.chunk)] = in.microbatch;
        if (g > 0) {
          EXPECT_TRUE(prev && prev->op == PipeOp::RecvActivation && same(*prev, in)) << "no RecvActivation";
        }
        if (g < last) {
          EXPECT_TRUE(next->op == PipeOp::SendActivation && same(*next, in)) << "no SendActivation";
        }
        break;
      case PipeOp::Backward:
        EXPECT_TRUE(bwd_at.emplace(std::pair{in.chunk, in.microbatch}, int(i)).second) << "second Backward";
        // Ascending order: the last microbatch's backward is the chunk's last,
        // which is where the runtime marks the chunk's gradients final.
        EXPECT_GT(in.microbatch, last_bwd[size_t(in.chunk)]) << "backwards out of microbatch order";
        last_bwd[size_t(in.chunk)] = in.microbatch;
        if (g < last) {
          EXPECT_TRUE(prev && prev->op == PipeOp::RecvGradient && same(*prev, in)) << "no RecvGradient";
        }
        if (g > 0) {
          EXPECT_TRUE(next->op == PipeOp::SendGradient && same(*next, in)) << "no SendGradient";
        }
        break;
      default:
        break;
    }
  }
  SCOPED_TRACE("rank " + std::to_string(rank));
  for (int chunk = 0; chunk < c.v; ++chunk)
    for (int mb = 0; mb < c.m; ++mb) {
      const auto f = fwd_at.find({chunk, mb});
      const auto b = bwd_at.find({chunk, mb});
      ASSERT_TRUE(f != fwd_at.end()) << "no Forward of mb " << mb << " on chunk " << chunk;
      ASSERT_TRUE(b != bwd_at.end()) << "no Backward of mb " << mb << " on chunk " << chunk;
      EXPECT_LT(f->second, b->second) << "Backward before Forward of mb " << mb << " on chunk " << chunk;
    }
  EXPECT_EQ(fwd_at.size(), size_t(c.m * c.v));
  EXPECT_EQ(bwd_at.size(), size_t(c.m * c.v));
  for (int chunk = 0; chunk < c.v; ++chunk) EXPECT_EQ(last_bwd[size_t(chunk)], c.m - 1) << "chunk " << chunk;
}

TEST(ScheduleStructure, EveryListIsWellFormed) {
  for (const Case& c : supported_cases({1, 2, 4, 8}))
    for (int rank = 0; rank < c.p; ++rank) {
      SCOPED_TRACE(c.str());
      check_list(c, rank, make_schedule(c.kind, c.p, rank, c.m, c.v));
      if (HasFatalFailure()) return;
    }
}

TEST(ScheduleStructure, EndStagesHaveNoOuterCommunication) {
  // Spelled out for the stages the rule is about: rank 0's chunk 0 is the
  // first model chunk, rank p - 1's chunk v - 1 the last.
  for (const Case& c : supported_cases({2, 4, 8})) {
    SCOPED_TRACE(c.str());
    for (const PipeInstr& in : make_schedule(c.kind, c.p, 0, c.m, c.v)) {
      if (in.chunk != 0) continue;
      EXPECT_TRUE(in.op != PipeOp::RecvActivation && in.op != PipeOp::SendGradient) << pipe_op_name(in.op);
    }
    for (const PipeInstr& in : make_schedule(c.kind, c.p, c.p - 1, c.m, c.v)) {
      if (in.chunk != c.v - 1) continue;
      EXPECT_TRUE(in.op != PipeOp::SendActivation && in.op != PipeOp::RecvGradient) << pipe_op_name(in.op);
    }
  }
}

TEST(ScheduleStructure, WarmupLengths) {
  // Leading forwards before the first backward: the warm-up plus the steady
  // state's first forward. Interleaved warms up (p - r - 1) * 2 + (v - 1) p
  // chunk-forwards, or all of them when m == p (Megatron's rule).
  for (const Case& c : supported_cases({1, 2, 4, 8}))
    for (int rank = 0; rank < c.p; ++rank) {
      SCOPED_TRACE(c.str() + " rank=" + std::to_string(rank));
      const int total = c.m * c.v;
      int expected = total;
      if (c.kind == ScheduleKind::OneFOneB) expected = std::min(c.p - rank, c.m);
      if (c.kind == ScheduleKind::Interleaved && c.m != c.p)
        expected = std::min(total, (c.p - rank - 1) * 2 + (c.v - 1) * c.p + 1);
      int leading = 0;
      for (const PipeInstr& in : make_schedule(c.kind, c.p, rank, c.m, c.v)) {
        if (in.op == PipeOp::Backward) break;
        leading += in.op == PipeOp::Forward;
      }
      EXPECT_EQ(leading, expected);
    }
}

TEST(ScheduleStructure, ListsAreDeterministic) {
  // A pure function: the executor on every rank and the simulator must see the same list.
  for (const Case& c : supported_cases({4}))
    for (int rank = 0; rank < c.p; ++rank) {
      SCOPED_TRACE(c.str());
      const auto a = make_schedule(c.kind, c.p, rank, c.m, c.v), b = make_schedule(c.kind, c.p, rank, c.m, c.v);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(a[i].op == b[i].op && a[i].microbatch == b[i].microbatch && a[i].chunk == b[i].chunk) << i;
    }
}

// ---------------------------------------------------------------- simulator

TEST(SimulatorTransfer, ZeroTransferMakespanIsFillPlusWork) {
  for (ScheduleKind kind : {ScheduleKind::OneFOneB, ScheduleKind::GPipe})
    for (int p : {2, 4, 8})
      for (int m = 1; m <= 16; ++m)
        for (auto [f, b] : {std::pair{1.0, 1.0}, {1.0, 2.0}, {0.5, 1.5}}) {
          SCOPED_TRACE(label(kind, p, m, 1) + " f=" + std::to_string(f) + " b=" + std::to_string(b));
          const SimResult r = simulate(kind, p, m, 1, equal_costs(f, b, 0));
          ASSERT_TRUE(r.ok) << r.error;
          EXPECT_NEAR(r.makespan, (m + p - 1) * (f + b), 1e-9);
        }
}

TEST(SimulatorTransfer, TransferCostRaisesMakespanAndBubbleMonotonically) {
  const double transfers[] = {0, 0.01, 0.1, 0.25, 0.5, 1, 2};
  for (const Case& c : supported_cases({2, 4, 8})) {
    if (c.m % 4 != 0 || c.v > 2) continue;  // a spread of cases keeps this quick
    SCOPED_TRACE(c.str());
    SimResult prev;
    for (double t : transfers) {
      SCOPED_TRACE("transfer=" + std::to_string(t));
      const SimResult r = simulate(c.kind, c.p, c.m, c.v, equal_costs(1, 2, t));
      ASSERT_TRUE(r.ok) << r.error;
      // Transfers take no rank time, so only the idle part can grow.
      for (int rank = 0; rank < c.p; ++rank) EXPECT_NEAR(r.busy[size_t(rank)], 3.0 * c.m, 1e-9);
      if (t > 0) {
        // Strictly: a path without a transfer stays on one rank and is shorter
        // than the makespan (the bubble is > 0), so every critical path pays t.
        EXPECT_GT(r.makespan, prev.makespan);
        EXPECT_GT(r.bubble_fraction, prev.bubble_fraction);
      }
      prev = r;
    }
  }
}

TEST(SimulatorTransfer, GPipeChargesEachBoundaryTwice) {
  // GPipe's critical path is one forward fill and one backward drain, each
  // crossing p - 1 boundaries: the makespan grows by exactly 2 (p - 1) t.
  for (int p : {2, 4, 8})
    for (int m : {1, 3, 8, 16}) {
      SCOPED_TRACE(label(ScheduleKind::GPipe, p, m, 1));
      const SimResult r = simulate(ScheduleKind::GPipe, p, m, 1, equal_costs(1, 2, 0.5));
      ASSERT_TRUE(r.ok) << r.error;
      EXPECT_NEAR(r.makespan, 3.0 * (m + p - 1) + 2 * (p - 1) * 0.5, 1e-9);
    }
}

TEST(SimulatorCosts, PerRankCostsReplaceTheScalars) {
  for (const Case& c : supported_cases({4})) {
    if (c.m % 4 != 0) continue;
    SCOPED_TRACE(c.str());
    // Per-rank costs that are all equal reproduce the scalar costs exactly.
    SimCosts same = equal_costs(1, 2, 0.25);
    same.forward_per_rank.assign(4, 1.0);
    same.backward_per_rank.assign(4, 2.0);
    const SimResult a = simulate(c.kind, 4, c.m, c.v, same), b = simulate(c.kind, 4, c.m, c.v, equal_costs(1, 2, 0.25));
    ASSERT_TRUE(a.ok && b.ok) << a.error << b.error;
    EXPECT_EQ(a.makespan, b.makespan);
    EXPECT_EQ(a.bubble_fraction, b.bubble_fraction);
  }
  // One slow stage paces GPipe: each phase is one pass through every stage
  // plus m - 1 more microbatches at the slowest stage's rate.
  SimCosts slow = equal_costs(1, 2);
  slow.forward_per_rank = {1, 1, 2, 1};
  slow.backward_per_rank = {2, 2, 4, 2};
  for (int m : {1, 4, 8}) {
    const SimResult r = simulate(ScheduleKind::GPipe, 4, m, 1, slow);
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_NEAR(r.makespan, (5 + (m - 1) * 2) + (10 + (m - 1) * 4), 1e-9) << "m=" << m;
  }
}

// ---------------------------------------------------------------- errors

// Runs `fn`, expects a Config error, and returns its message.
template <class Fn>
std::string config_error(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

TEST(ScheduleErrors, InterleavedNeedsMicrobatchesAMultipleOfPp) {
  for (int p : {2, 4, 8})
    for (int m = 1; m <= 16; ++m) {
      if (m % p == 0) continue;
      for (int v : {2, 3}) {
        SCOPED_TRACE(label(ScheduleKind::Interleaved, p, m, v));
        for (int rank : {0, p - 1}) {
          const std::string msg = config_error([&] { make_schedule(ScheduleKind::Interleaved, p, rank, m, v); });
          EXPECT_NE(msg.find("parallel.pp"), std::string::npos) << msg;
          EXPECT_NE(msg.find(str_cat("(", m, ")")), std::string::npos) << msg;
          EXPECT_NE(msg.find(str_cat("(", p, ")")), std::string::npos) << msg;
        }
        // The simulator builds the same lists, so it rejects the same way.
        config_error([&] { simulate(ScheduleKind::Interleaved, p, m, v, {}); });
      }
    }
}

TEST(ScheduleErrors, VirtualStagesMustMatchTheKind) {
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB})
    for (int v : {2, 4}) {
      SCOPED_TRACE(label(kind, 4, 8, v));
      const std::string msg = config_error([&] { make_schedule(kind, 4, 0, 8, v); });
      EXPECT_NE(msg.find("parallel.virtual_stages"), std::string::npos) << msg;
      EXPECT_NE(msg.find(schedule_name(kind)), std::string::npos) << msg;
    }
  const std::string msg = config_error([] { make_schedule(ScheduleKind::Interleaved, 4, 0, 8, 1); });
  EXPECT_NE(msg.find("parallel.virtual_stages"), std::string::npos) << msg;
}

TEST(ScheduleErrors, OutOfRangeArguments) {
  struct Bad {
    int p, rank, m, v;
  };
  const Bad bad[] = {{0, 0, 4, 1}, {-1, 0, 4, 1}, {4, -1, 4, 1}, {4, 4, 4, 1},
                     {4, 7, 4, 1}, {4, 0, 0, 1},  {4, 0, -4, 1}, {4, 0, 4, 0}};
  for (ScheduleKind kind : kAllKinds)
    for (const Bad& a : bad) {
      const int v = kind == ScheduleKind::Interleaved && a.v == 1 ? 2 : a.v;
      SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(a.p) + " rank=" + std::to_string(a.rank) +
                   " m=" + std::to_string(a.m) + " v=" + std::to_string(v));
      const std::string msg = config_error([&] { make_schedule(kind, a.p, a.rank, a.m, v); });
      EXPECT_NE(msg.find("out of range"), std::string::npos) << msg;
    }
}

TEST(ScheduleErrors, ParseRejectsUnknownNamesAndRoundTrips) {
  for (ScheduleKind kind : kAllKinds) EXPECT_EQ(parse_schedule(schedule_name(kind), "parallel.schedule"), kind);
  for (const char* name : {"pipedream", "", "GPipe", "1F1B", "interleaved "}) {
    SCOPED_TRACE(std::string("name='") + name + "'");
    const std::string msg = config_error([&] { parse_schedule(name, "parallel.schedule"); });
    EXPECT_NE(msg.find("parallel.schedule"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("'") + name + "'"), std::string::npos) << msg;
  }
}

// ---------------------------------------------------------------- zero bubble

// Qi et al. 2024, Table 2, with m >= p: each stage idles (p - 1)(F + B + W)
// under 1F1B and (p - 1)(F + B - W) under ZB-H1 (W <= F; a longer W fills
// no more than the forward's gap), both at 1F1B's peak of p microbatches
// in flight. Written out here, not read from bubble_time(), so that both
// are checked.
TEST(ZeroBubbleH1, TableTwoBubbleAtOneFOneBsPeakMemory) {
  const double times[][3] = {{1, 1, 1}, {1, 1.2, 0.8}, {1, 1.5, 0.5}, {2, 1, 1}, {1, 2, 1}, {1, 1, 1.5}, {0.7, 1.3, 0.4}};
  for (int p : {2, 3, 4, 8})
    for (int m = p; m <= 4 * p; ++m)
      for (const auto& t : times) {
        const double f = t[0], b = t[1], w = t[2];
        SCOPED_TRACE(label(ScheduleKind::ZeroBubbleH1, p, m, 1) + " F=" + std::to_string(f) + " B=" +
                     std::to_string(b) + " W=" + std::to_string(w));
        const SimResult zb = simulate(ScheduleKind::ZeroBubbleH1, p, m, 1, fbw(f, b, w));
        const SimResult fb = simulate(ScheduleKind::OneFOneB, p, m, 1, fbw(f, b, w));
        ASSERT_TRUE(zb.ok && fb.ok) << zb.error << fb.error;
        const double zb_idle = (p - 1) * (f + b - std::min(w, f)), fb_idle = (p - 1) * (f + b + w);
        EXPECT_NEAR(bubble_time(ScheduleKind::ZeroBubbleH1, p, f, b, w), zb_idle, 1e-12);
        EXPECT_NEAR(bubble_time(ScheduleKind::OneFOneB, p, f, b, w), fb_idle, 1e-12);
        for (int rank = 0; rank < p; ++rank) {
          EXPECT_NEAR(zb.busy[size_t(rank)], m * (f + b + w), 1e-9);
          EXPECT_NEAR(zb.makespan - zb.busy[size_t(rank)], zb_idle, 1e-9) << "rank " << rank;
          EXPECT_NEAR(fb.makespan - fb.busy[size_t(rank)], fb_idle, 1e-9) << "rank " << rank;
          // Activations live from the forward to the weight part: p on every stage, 1F1B's stage 0.
          EXPECT_EQ(zb.peak_in_flight[size_t(rank)], p) << "rank " << rank;
          EXPECT_EQ(max_in_flight(make_schedule(ScheduleKind::ZeroBubbleH1, p, rank, m, 1), 1), p);
        }
        EXPECT_EQ(*std::max_element(fb.peak_in_flight.begin(), fb.peak_in_flight.end()), p);
      }
  // Equal F, B and W: a third of 1F1B's bubble, the analytic fraction.
  const SimResult r = simulate(ScheduleKind::ZeroBubbleH1, 4, 12, 1, fbw(1, 1, 1));
  EXPECT_NEAR(r.bubble_fraction, analytic_bubble(ScheduleKind::ZeroBubbleH1, 4, 12, 1), 1e-12);
  EXPECT_NEAR(r.bubble_fraction, 3.0 / (3 * 12 + 3), 1e-12);
}

// Every list, any m (fewer microbatches than stages too): each microbatch
// has its forward, input part and weight part once, in that order, the
// weight parts in microbatch order; the input part receives and sends the
// gradient, the weight part neither; the simulator finds no deadlock.
TEST(ZeroBubbleH1, ListsAreWellFormed) {
  for (int p : {2, 3, 4, 8})  // one stage is refused (ScheduleRules.ZeroBubbleNeedsTwoStages)
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(label(ScheduleKind::ZeroBubbleH1, p, m, 1));
      const SimResult r = simulate(ScheduleKind::ZeroBubbleH1, p, m, 1, fbw(1, 1, 1));
      ASSERT_TRUE(r.ok) << r.error;
      for (int rank = 0; rank < p; ++rank) {
        const auto list = make_schedule(ScheduleKind::ZeroBubbleH1, p, rank, m, 1);
        std::map<std::pair<PipeOp, int>, int> count;
        std::vector<int> stage(size_t(m), 0);  // 0 none, 1 forward, 2 input, 3 weight
        int next_weight = 0;
        for (size_t i = 0; i < list.size(); ++i) {
          const PipeInstr& in = list[i];
          EXPECT_NE(in.op, PipeOp::Backward);
          if (in.microbatch < 0) continue;
          ++count[{in.op, in.microbatch}];
          int& st = stage[size_t(in.microbatch)];
          if (in.op == PipeOp::Forward) {
            EXPECT_EQ(st++, 0);
          }
          if (in.op == PipeOp::BackwardInput) {
            EXPECT_EQ(st++, 1);
            if (rank < p - 1) {
              EXPECT_EQ(list[i - 1].op, PipeOp::RecvGradient);
            }
            if (rank > 0) {
              EXPECT_EQ(list[i + 1].op, PipeOp::SendGradient);
            }
          }
          if (in.op == PipeOp::BackwardWeight) {
            EXPECT_EQ(st++, 2);
            EXPECT_EQ(in.microbatch, next_weight++);
          }
        }
        for (int mb = 0; mb < m; ++mb) EXPECT_EQ(stage[size_t(mb)], 3) << "microbatch " << mb << " rank " << rank;
        EXPECT_EQ(list.back().op, PipeOp::OptimizerStep);
      }
    }
  EXPECT_NE(config_error([] { make_schedule(ScheduleKind::ZeroBubbleH1, 2, 0, 4, 2); }).find("virtual_stages=2"),
            std::string::npos);
}

}  // namespace
}  // namespace xirang
