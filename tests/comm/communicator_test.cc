// Tests for the argument checks of comm/communicator.h: reduce_scatter and
// all_gather check the chunk once, in the base class, before any backend's
// hook runs, so a wrong call is refused the same way by every backend and a
// decorator (SimulatedLink) refuses it before it reaches the wrapped group.
// No MPI: a recording group of four stands in for a backend.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/simulated_link.h"
#include "core/error.h"
#include "core/tensor.h"
#include "tests/comm/completing_group.h"
#include "tests/support/expect_error.h"

namespace xirang {
namespace {

// Rank 1 of a group of four that counts the hook calls it receives.
struct RecordingGroup : CompletingGroup {
  RecordingGroup() : CompletingGroup(1, 4, "rec4") {}
};

Tensor view(std::vector<float>& v) { return Tensor(v.data(), {int64_t(v.size())}, DType::F32); }

// n = 10 over four ranks: rank 1's chunk is [2, 5).
TEST(CommunicatorChecks, ReduceScatterRefusesAWrongChunkBeforeTheBackend) {
  RecordingGroup g;
  std::vector<float> in(10), out(3), wrong(4);
  std::vector<uint16_t> half(3);
  expect_error([&] { g.reduce_scatter(view(in), view(wrong), ReduceOp::Sum); }, ErrorKind::Comm,
               {"rec4 reduce_scatter of 40 bytes (f32)", "must hold this rank's chunk", "3 elements [2, 5)",
                "rank 1 of 4 in group rec4"});
  expect_error([&] { g.reduce_scatter(view(in), Tensor(half.data(), {3}, DType::BF16), ReduceOp::Sum); },
               ErrorKind::Comm, {"rec4 reduce_scatter", "different dtypes"});
  expect_error([&] { g.reduce_scatter(view(in), view(in).flat_range(1, 4), ReduceOp::Sum); }, ErrorKind::Comm,
               {"rec4 reduce_scatter", "overlaps input", "without being this rank's chunk"});
  EXPECT_EQ(g.hook_calls, 0);
  g.reduce_scatter(view(in), view(out), ReduceOp::Sum);
  g.reduce_scatter(view(in), view(in).flat_range(2, 5), ReduceOp::Sum);  // in place
  EXPECT_EQ(g.hook_calls, 2);
}

TEST(CommunicatorChecks, AllGatherRefusesAWrongChunkBeforeTheBackend) {
  RecordingGroup g;
  std::vector<float> out(10), in(3), wrong(2);
  expect_error([&] { g.all_gather(view(wrong), view(out)); }, ErrorKind::Comm,
               {"rec4 all_gather of 40 bytes (f32)", "must be this rank's chunk", "3 elements [2, 5)"});
  std::vector<double> in64(3);
  expect_error([&] { g.all_gather(Tensor(in64.data(), {3}, DType::F64), view(out)); }, ErrorKind::Comm,
               {"rec4 all_gather", "different dtypes"});
  expect_error([&] { g.all_gather(view(out).flat_range(3, 6), view(out)); }, ErrorKind::Comm,
               {"rec4 all_gather", "overlaps output", "without being this rank's chunk"});
  EXPECT_EQ(g.hook_calls, 0);
  g.all_gather(view(in), view(out));
  g.all_gather(view(out).flat_range(2, 5), view(out));  // in place
  EXPECT_EQ(g.hook_calls, 2);
}

// A group of one: the chunk is the whole buffer, checked like any other.
TEST(CommunicatorChecks, LocalGroupChecksLikeEveryBackend) {
  LocalCommunicator local("solo");
  std::vector<float> in(6), out(6), short_out(5);
  expect_error([&] { local.reduce_scatter(view(in), view(short_out), ReduceOp::Sum); }, ErrorKind::Comm,
               {"solo reduce_scatter of 24 bytes", "must hold this rank's chunk", "6 elements [0, 6)"});
  expect_error([&] { local.all_gather(view(short_out), view(out)); }, ErrorKind::Comm,
               {"solo all_gather", "must be this rank's chunk"});
  in = {1, 2, 3, 4, 5, 6};
  local.all_gather(view(in), view(out));
  EXPECT_EQ(out, in);
}

// The decorator refuses in its own name, before the wrapped group or the
// fault countdown sees the call: a refused call is no transfer.
TEST(CommunicatorChecks, SimulatedLinkRefusesBeforeTheWrappedGroup) {
  auto inner = std::make_unique<RecordingGroup>();
  RecordingGroup& rec = *inner;
  SimulatedLink link(std::move(inner), {}, 60);
  std::vector<float> in(10), out(3), wrong(4);
  link.fail_next(1);
  expect_error([&] { link.reduce_scatter(view(in), view(wrong), ReduceOp::Sum); }, ErrorKind::Comm,
               {"rec4 reduce_scatter", "must hold this rank's chunk"});
  EXPECT_EQ(rec.hook_calls, 0);
  expect_error([&] { link.reduce_scatter(view(in), view(out), ReduceOp::Sum); }, ErrorKind::Comm,
               {"injected transfer failure"});  // the countdown was still at 1
  link.reduce_scatter(view(in), view(out), ReduceOp::Sum);
  EXPECT_EQ(rec.hook_calls, 1);
}

// All-to-all-v's counts are checked in the base class too: one per rank,
// summing to the rows of each side, this rank's own rows equal on both.
TEST(CommunicatorChecks, AllToAllVRefusesBadCountsBeforeTheBackend) {
  auto inner = std::make_unique<RecordingGroup>();
  RecordingGroup& rec = *inner;
  SimulatedLink link(std::move(inner), {}, 60);
  std::vector<float> send(12), recv(8);
  auto rows = [](std::vector<float>& v) { return Tensor(v.data(), {int64_t(v.size()) / 2, 2}, DType::F32); };
  expect_error([&] { link.all_to_all_v(rows(send), {1, 2, 3}, rows(recv), {1, 1, 1, 1}); }, ErrorKind::Comm,
               {"rec4 all_to_all_v (f32): send_counts has 3 entries [1, 2, 3]", "one per rank of the group (4)",
                "rank 1 of 4 in group rec4"});
  expect_error([&] { link.all_to_all_v(rows(send), {1, 2, 2, 0}, rows(recv), {1, 2, 1, 0}); }, ErrorKind::Comm,
               {"send_counts [1, 2, 2, 0] sum to 5 rows but the send tensor f32(6, 2) cpu has 6"});
  expect_error([&] { link.all_to_all_v(rows(send), {1, 2, 2, 1}, rows(recv), {1, 1, 1, 1}); }, ErrorKind::Comm,
               {"send_counts[1] = 2 but recv_counts[1] = 1"});
  EXPECT_EQ(rec.hook_calls, 0);
  link.all_to_all_v(rows(send), {1, 2, 2, 1}, rows(recv), {1, 2, 1, 0});
  EXPECT_EQ(rec.hook_calls, 1);
}

}  // namespace
}  // namespace xirang
