// Tests for comm/comm_trace.h: the ring keeps the newest operations in
// posting order with their states, an update for an operation the ring no
// longer holds changes nothing, and dump() writes one parseable file once.
// (The MPI channels' recording and `xirang diagnose` are tested end to end
// by tests/parallel/fault_test.sh's hang cases.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "comm/comm_trace.h"

namespace xirang {
namespace {

TEST(CommTrace, KeepsTheNewestOperationsInOrderWithTheirStates) {
  CommTrace t(2, 4, "", 4);
  const int dp = t.add_channel("dp", 1, {0, 2});
  const int pp = t.add_channel("pp", 0, {2, 3});
  uint64_t ids[6];
  for (int i = 0; i < 6; ++i)
    ids[i] = t.posted(i % 2 ? pp : dp, i % 2 ? CommOpKind::Recv : CommOpKind::AllReduce, i % 2 ? 1 : -1,
                      i % 2 ? 7 : -1, 100 * (i + 1), uint64_t(i / 2 + 1), 10.0 + i);
  t.started(ids[4], 20.0);
  t.completed(ids[5], true, 21.0);
  t.completed(ids[0], true, 22.0);  // overwritten by ids[4]: must change nothing
  const auto r = t.records();
  ASSERT_EQ(r.size(), 4u);
  for (size_t i = 0; i < r.size(); ++i) EXPECT_EQ(r[i].id, ids[i + 2]) << i;
  EXPECT_EQ(r[0].state, CommOpState::Posted);
  EXPECT_EQ(r[2].state, CommOpState::InFlight);
  EXPECT_EQ(r[2].started_s, 20.0);
  EXPECT_EQ(r[2].completed_s, 0.0);
  EXPECT_EQ(r[3].state, CommOpState::Done);
  EXPECT_EQ(r[3].kind, CommOpKind::Recv);
  EXPECT_EQ(r[3].peer, 1);
  EXPECT_EQ(r[3].tag, 7);
  EXPECT_EQ(r[3].bytes, 600);
  EXPECT_EQ(r[3].seq, 3u);
  EXPECT_EQ(r[3].channel, pp);
}

TEST(CommTrace, ChannelsOfTheSameGroupAreNumbered) {
  CommTrace t(0, 2, "");
  t.add_channel("world", 0, {0, 1});
  t.add_channel("dp", 0, {0, 1});
  t.add_channel("dp", 0, {0, 1});
  const auto c = t.channels();
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[1].instance, 0);
  EXPECT_EQ(c[2].instance, 1);
  EXPECT_EQ(c[2].world_ranks, (std::vector<int>{0, 1}));
}

TEST(CommTrace, DumpsOnceAsJson) {
  const std::string dir = std::filesystem::temp_directory_path() / "xirang_comm_trace_test";
  std::filesystem::remove_all(dir);
  CommTrace t(3, 4, dir);
  const int ch = t.add_channel("tp", 1, {2, 3});
  const uint64_t a = t.posted(ch, CommOpKind::AllGather, -1, -1, 64, 1, 1.0);
  t.completed(a, false, 2.0);
  t.posted(ch, CommOpKind::Send, 0, 5, 32, 1, 3.0);
  const std::string path = t.dump("tp all_gather \"x\" timed out\n");
  ASSERT_EQ(path, dir + "/comm_trace.rank3.json");
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["format"], "xirang-comm-trace-1");
  EXPECT_EQ(j["rank"], 3);
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["reason"], "tp all_gather \"x\" timed out\n");
  EXPECT_EQ(j["channels"][0]["world_ranks"], nlohmann::json::array({2, 3}));
  ASSERT_EQ(j["ops"].size(), 2u);
  EXPECT_EQ(j["ops"][0]["kind"], "all_gather");
  EXPECT_EQ(j["ops"][0]["state"], "failed");
  EXPECT_EQ(j["ops"][1]["kind"], "send");
  EXPECT_EQ(j["ops"][1]["state"], "posted");
  EXPECT_EQ(j["ops"][1]["peer"], 0);
  EXPECT_EQ(j["ops"][1]["tag"], 5);
  // A second failure on another channel keeps the first dump.
  std::filesystem::remove(path);
  EXPECT_EQ(t.dump("later"), path);
  EXPECT_FALSE(std::filesystem::exists(path));
  std::filesystem::remove_all(dir);
}

TEST(CommTrace, WithoutADirectoryDumpsNothing) {
  CommTrace t(0, 1, "");
  EXPECT_EQ(t.dump("x"), "");
}

}  // namespace
}  // namespace xirang
