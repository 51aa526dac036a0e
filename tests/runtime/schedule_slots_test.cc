// Tests for runtime/step/schedule.h's slot_counts: the pools a chunk's
// activations need under a schedule, found by walking its list. ZB-H1 frees
// a microbatch's activation slot at its input part (1F1B's activation
// slots), keeps the weight part's layer inputs in an input slot from the
// forward to the weight part and its copied operands in a weight slot from
// the input part to the weight part (rank r of p: r + 1; 2r + 1 under ZB-H2); a replay of every
// list with pools of those sizes never runs out and never hands a
// microbatch's input or weight slot to another before its weight part.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "runtime/step/schedule.h"

namespace xirang {
namespace {

std::string label(ScheduleKind kind, int p, int rank, int m) {
  return std::string(schedule_name(kind)) + " p=" + std::to_string(p) + " rank=" + std::to_string(rank) +
         " m=" + std::to_string(m);
}

TEST(SlotCounts, ZeroBubbleH1FreesTheActivationSlotAtTheInputPart) {
  for (int p : {2, 3, 4, 8})
    for (int m = 1; m <= 4 * p; ++m)
      for (int rank = 0; rank < p; ++rank) {
        SCOPED_TRACE(label(ScheduleKind::ZeroBubbleH1, p, rank, m));
        const auto zb = make_schedule(ScheduleKind::ZeroBubbleH1, p, rank, m, 1);
        const auto fb = make_schedule(ScheduleKind::OneFOneB, p, rank, m, 1);
        const SlotCounts s = slot_counts(zb, 1, 0);
        // Forward to input part: 1F1B's forward to backward.
        EXPECT_EQ(s.activation, max_in_flight(fb, 1));
        EXPECT_EQ(s.activation, std::min(p - rank, m));
        // Forward to weight part: p once m >= p (every stage, as 1F1B's stage 0).
        EXPECT_EQ(s.input, max_in_flight(zb, 1));
        if (m >= p) {
          EXPECT_EQ(s.input, p);
        }
        // Input part to weight part: the rank's deferral plus the one just run.
        EXPECT_EQ(s.weight, std::min(rank + 1, m));
        EXPECT_EQ(slot_counts(zb, 1, 2).activation, s.activation + 2);
      }
}

TEST(SlotCounts, UnsplitListsNeedActivationSlotsOnly) {
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved})
    for (int p : {2, 4})
      for (int m : {p, 2 * p, 4 * p})
        for (int rank = 0; rank < p; ++rank) {
          const int v = kind == ScheduleKind::Interleaved ? 2 : 1;
          SCOPED_TRACE(label(kind, p, rank, m));
          const auto list = make_schedule(kind, p, rank, m, v);
          const SlotCounts s = slot_counts(list, v, 2);
          EXPECT_EQ(s.activation, max_in_flight(list, v) + 2);
          EXPECT_EQ(s.input, 0);
          EXPECT_EQ(s.weight, 0);
        }
}

// The executor's discipline (runtime/step/pipeline.cc) with pools of
// slot_counts' sizes: a forward takes an activation slot and an input slot,
// the input part frees the activation slot and takes a weight slot, the
// weight part frees both. No pool runs out, and each weight part finds its
// own microbatch in its input and weight slots (no other took them since).
TEST(SlotCounts, ReplayOfEveryZeroBubbleListFitsAndKeepsTheWeightPartsSlots) {
  struct Pool {
    std::vector<int> owner;  // microbatch in each slot, -1 free
    int take(int mb) {
      auto it = std::find(owner.begin(), owner.end(), -1);
      if (it == owner.end()) return -1;
      *it = mb;
      return int(it - owner.begin());
    }
  };
  for (ScheduleKind kind : {ScheduleKind::ZeroBubbleH1, ScheduleKind::ZeroBubbleH2})
  for (int p : {2, 3, 4, 8})
    for (int m = 1; m <= 4 * p; ++m)
      for (int rank = 0; rank < p; ++rank) {
        SCOPED_TRACE(label(kind, p, rank, m));
        const auto list = make_schedule(kind, p, rank, m, 1);
        const SlotCounts s = slot_counts(list, 1, 0);
        Pool act{std::vector<int>(size_t(s.activation), -1)}, in{std::vector<int>(size_t(s.input), -1)},
            w{std::vector<int>(size_t(s.weight), -1)};
        std::map<int, int> act_of, in_of, w_of;
        for (const PipeInstr& i : list) {
          const int mb = i.microbatch;
          if (i.op == PipeOp::Forward) {
            act_of[mb] = act.take(mb);
            in_of[mb] = in.take(mb);
            ASSERT_GE(act_of[mb], 0) << "no activation slot for the forward of microbatch " << mb;
            ASSERT_GE(in_of[mb], 0) << "no input slot for the forward of microbatch " << mb;
          } else if (i.op == PipeOp::BackwardInput) {
            ASSERT_EQ(act.owner[size_t(act_of.at(mb))], mb);
            act.owner[size_t(act_of[mb])] = -1;
            w_of[mb] = w.take(mb);
            ASSERT_GE(w_of[mb], 0) << "no weight slot for the input part of microbatch " << mb;
          } else if (i.op == PipeOp::BackwardWeight) {
            ASSERT_EQ(in.owner[size_t(in_of.at(mb))], mb) << "microbatch " << mb << "'s input slot was reused";
            ASSERT_EQ(w.owner[size_t(w_of.at(mb))], mb) << "microbatch " << mb << "'s weight slot was reused";
            in.owner[size_t(in_of[mb])] = -1;
            w.owner[size_t(w_of[mb])] = -1;
          }
        }
        for (const auto* pool : {&act, &in, &w})
          EXPECT_TRUE(std::all_of(pool->owner.begin(), pool->owner.end(), [](int o) { return o == -1; }));
      }
}

}  // namespace
}  // namespace xirang
