// ScheduleRules: what each pipeline schedule needs of the layout, stated
// once (runtime/config/schedule_rules.h); make_schedule and the simulator
// refuse exactly what it refuses, with its words.
#include "runtime/config/schedule_rules.h"

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "runtime/step/schedule.h"

namespace xirang {
namespace {

constexpr ScheduleKind kKinds[] = {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved,
                                   ScheduleKind::ZeroBubbleH1, ScheduleKind::ZeroBubbleH2, ScheduleKind::ZeroBubbleV};

// The Config error fn throws, or "" when it throws none.
template <class Fn>
std::string config_error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config) << e.what();
    return e.what();
  }
  return "";
}

TEST(ScheduleRules, EachRuleNamesItsKeys) {
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleH1, 1, 1, 8),
            "parallel.schedule=zb_h1 needs parallel.pp >= 2 (one stage has no bubble for the split backward to fill)");
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleH1, 2, 1, 1), "");  // fewer microbatches than stages
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleH2, 1, 1, 8),
            "parallel.schedule=zb_h2 needs parallel.pp >= 2 (one stage has no bubble for the split backward to fill)");
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleH2, 4, 1, 2), "");  // fewer than 2p - 1: a shorter warm-up
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleV, 4, 1, 8),
            "parallel.schedule=zb_v needs parallel.virtual_stages=2 (its two chunks per rank make the V; got 1)");
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleV, 1, 2, 8),
            "parallel.schedule=zb_v needs parallel.pp >= 2 (one stage has no bubble for the split backward to fill)");
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleV, 4, 2, 3), "");  // any m
  // zb_v runs over tagged MPI channels on the CPU, without cp; the others anywhere.
  EXPECT_EQ(executor_problem(ScheduleKind::ZeroBubbleV, false, Backend::CPU, 1), "");
  EXPECT_EQ(executor_problem(ScheduleKind::ZeroBubbleV, true, Backend::CPU, 1).find("parallel.schedule=zb_v needs comm.ordered_p2p=false"), 0u);
  EXPECT_EQ(executor_problem(ScheduleKind::ZeroBubbleV, false, Backend::CUDA, 1).find("parallel.schedule=zb_v runs on device.backend=cpu only"), 0u);
  EXPECT_EQ(executor_problem(ScheduleKind::ZeroBubbleV, false, Backend::CPU, 2),
            "parallel.schedule=zb_v with parallel.cp=2 is untested: use parallel.cp=1");
  for (ScheduleKind kind : kKinds)
    if (kind != ScheduleKind::ZeroBubbleV) {
      EXPECT_EQ(executor_problem(kind, true, Backend::CUDA, 2), "") << schedule_name(kind);
    }
  EXPECT_EQ(schedule_problem(ScheduleKind::OneFOneB, 4, 2, 8),
            "parallel.virtual_stages=2 needs parallel.schedule=interleaved (got 1f1b)");
  EXPECT_EQ(schedule_problem(ScheduleKind::ZeroBubbleH1, 1, 2, 8),
            "parallel.virtual_stages=2 needs parallel.schedule=interleaved (got zb_h1)");
  EXPECT_EQ(schedule_problem(ScheduleKind::Interleaved, 2, 1, 8),
            "parallel.schedule=interleaved needs parallel.virtual_stages >= 2 (got 1)");
  EXPECT_EQ(schedule_problem(ScheduleKind::Interleaved, 3, 2, 8),
            "parallel.schedule=interleaved needs the microbatches per step (8) to be a multiple of parallel.pp (3)");
  EXPECT_EQ(schedule_problem(ScheduleKind::Interleaved, 3, 2, 8, "train.global_batch 8 / 1 = 8"),
            "parallel.schedule=interleaved needs the microbatches per step (train.global_batch 8 / 1 = 8) to be a "
            "multiple of parallel.pp (3)");
  EXPECT_EQ(schedule_problem(ScheduleKind::Interleaved, 3, 2, 9), "");
  EXPECT_EQ(schedule_problem(ScheduleKind::GPipe, 1, 1, 1), "");
}

// Over every kind and a grid of layouts, the schedule's list exists exactly
// where the rules allow it, and a refusal is the rule's message; the
// simulator, which builds every rank's list, agrees.
TEST(ScheduleRules, MakeScheduleAndSimulateRefuseExactlyWhatTheRulesRefuse) {
  int refused = 0, built = 0;
  for (ScheduleKind kind : kKinds)
    for (int p = 1; p <= 4; ++p)
      for (int v = 1; v <= 3; ++v)
        for (int m = 1; m <= 8; ++m) {
          SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(p) + " v=" + std::to_string(v) +
                       " m=" + std::to_string(m));
          const std::string rule = schedule_problem(kind, p, v, m);
          (rule.empty() ? built : refused) += 1;
          for (int rank = 0; rank < p; ++rank)
            EXPECT_EQ(config_error_of([&] { make_schedule(kind, p, rank, m, v); }), rule) << "rank " << rank;
          EXPECT_EQ(config_error_of([&] { simulate(kind, p, m, v, SimCosts{}); }), rule);
        }
  EXPECT_GT(refused, 0);
  EXPECT_GT(built, 0);
}

// One stage under zb_h1: the config, the list and the simulator all refuse it.
TEST(ScheduleRules, ZeroBubbleNeedsTwoStages) {
  for (int m : {1, 4, 8}) {
    EXPECT_NE(config_error_of([&] { make_schedule(ScheduleKind::ZeroBubbleH1, 1, 0, m, 1); }).find("zb_h1 needs parallel.pp >= 2"),
              std::string::npos);
    EXPECT_NE(config_error_of([&] { simulate(ScheduleKind::ZeroBubbleH1, 1, m, 1, SimCosts{}); }).find("parallel.pp >= 2"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace xirang
