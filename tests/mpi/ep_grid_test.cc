// Tests of the process grid's expert-parallel groups: ep() (the ep
// consecutive dp indices of one (cp, tp, pp) position that share the experts
// out) and expert_dp() (the ranks holding the same experts, over which their
// gradients reduce). Members are checked in group order against tables
// written out by hand for the layouts of the issue, and against a filter of
// the world's coordinates for every layout of the world size.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <vector>

#include "comm/process_grid.h"
#include "tests/mpi/mpi_test_util.h"

namespace xirang::test {
namespace {

std::string shape_str(const GridShape& s) {
  return str_cat("dp=", s.dp, " cp=", s.cp, " tp=", s.tp, " pp=", s.pp, " ep=", s.ep);
}

// The group's world ranks in the order of its ranks (an all-reduce of
// one-hot rows), so that membership and order are both checked.
std::vector<int> members(Communicator& group) {
  std::vector<double> rows(size_t(group.size()), 0.0);
  rows[size_t(group.rank())] = world_rank();
  group.all_reduce(Tensor(rows.data(), {int64_t(rows.size())}, DType::F64), ReduceOp::Sum);
  return std::vector<int>(rows.begin(), rows.end());
}

// The world ranks that pass `same`, ordered by `order` (a filter over every
// rank's coordinates: independent of the grid's split colours and keys).
std::vector<int> expected(const GridShape& s, const std::function<bool(const GridCoords&)>& same,
                          const std::function<int(const GridCoords&)>& order) {
  std::vector<std::pair<int, int>> keyed;
  for (int r = 0; r < s.world(); ++r) {
    const GridCoords c = grid_coords(s, r);
    if (same(c)) keyed.emplace_back(order(c), r);
  }
  std::sort(keyed.begin(), keyed.end());
  std::vector<int> out;
  for (auto& [k, r] : keyed) out.push_back(r);
  return out;
}

void check_ep_groups(ProcessGrid& g, const GridShape& s) {
  const GridCoords me = g.coords();
  const int ep = s.ep;
  const auto want_ep = expected(
      s,
      [&](const GridCoords& c) { return c.pp == me.pp && c.cp == me.cp && c.tp == me.tp && c.dp / ep == me.dp / ep; },
      [](const GridCoords& c) { return c.dp; });
  const auto want_edp = expected(
      s, [&](const GridCoords& c) { return c.pp == me.pp && c.tp == me.tp && c.dp % ep == me.dp % ep; },
      [&](const GridCoords& c) { return (c.dp / ep) * s.cp + c.cp; });
  EXPECT_EQ(members(g.ep()), want_ep);
  EXPECT_EQ(g.ep().rank(), me.dp % ep);
  EXPECT_EQ(g.ep().size(), ep);
  EXPECT_EQ(members(g.expert_dp()), want_edp);
  EXPECT_EQ(g.expert_dp().size(), s.dp / ep * s.cp);
  EXPECT_EQ(g.expert_dp().rank(), (me.dp / ep) * s.cp + me.cp);
}

// The layouts of the issue on 4 ranks, the groups written out by hand:
// for each world rank, its ep group and its expert-dp group.
struct Table {
  GridShape shape;
  std::vector<std::vector<int>> ep, expert_dp;  // [world rank]
};

TEST(EpGridMpi, HandWrittenGroupsOnFourRanks) {
  if (world_size() != 4) GTEST_SKIP() << "the tables are for 4 ranks";
  const std::vector<Table> tables = {
      // dp=4 ep=2: experts halved over {0,1} and {2,3}; ranks 0 and 2 hold the same half.
      {{.dp = 4, .ep = 2}, {{0, 1}, {0, 1}, {2, 3}, {2, 3}}, {{0, 2}, {1, 3}, {0, 2}, {1, 3}}},
      // dp=4 ep=4: every rank holds its own quarter; no copies.
      {{.dp = 4, .ep = 4}, {{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}}, {{0}, {1}, {2}, {3}}},
      // dp=2 cp=2 ep=2: rank = dp * 2 + cp; ep spans dp at one cp index, the copies are the cp ranks.
      {{.dp = 2, .cp = 2, .ep = 2}, {{0, 2}, {1, 3}, {0, 2}, {1, 3}}, {{0, 1}, {0, 1}, {2, 3}, {2, 3}}},
      // tp=2 dp=2 ep=2: rank = dp * 2 + tp; ep spans dp at one tp index, each shard held once per tp index.
      {{.dp = 2, .tp = 2, .ep = 2}, {{0, 2}, {1, 3}, {0, 2}, {1, 3}}, {{0}, {1}, {2}, {3}}},
  };
  for (const Table& t : tables) {
    SCOPED_TRACE(shape_str(t.shape));
    auto g = ProcessGrid::create_mpi(t.shape, kOpts);
    const int w = world_rank();
    EXPECT_EQ(members(g->ep()), t.ep[size_t(w)]);
    EXPECT_EQ(members(g->expert_dp()), t.expert_dp[size_t(w)]);
    EXPECT_EQ(g->ep().name(), "ep");
    EXPECT_EQ(g->expert_dp().name(), "expert_dp");
    // The world and its rank order do not change with ep.
    EXPECT_EQ(g->world().size(), 4);
    EXPECT_EQ(members(g->dp_grads()), members(g->dp_cp()));
  }
}

// Every layout of the world size with every ep dividing its dp.
TEST(EpGridMpi, EveryLayoutAndEveryEp) {
  const int w = world_size();
  for (int pp = 1; pp <= w; ++pp)
    for (int tp = 1; tp <= w; ++tp)
      for (int cp = 1; cp <= w; ++cp) {
        if (w % (pp * tp * cp) != 0) continue;
        const int dp = w / (pp * tp * cp);
        for (int ep = 1; ep <= dp; ++ep) {
          if (dp % ep != 0) continue;
          const GridShape s{.dp = dp, .tp = tp, .pp = pp, .cp = cp, .ep = ep};
          SCOPED_TRACE(shape_str(s));
          auto g = ProcessGrid::create_mpi(s, kOpts);
          check_ep_groups(*g, s);
        }
      }
}

// ep = 1: each rank is its own ep group and the expert copies are the dense
// ones: expert_dp() is dp_grads() itself, no extra channel.
TEST(EpGridMpi, EpOneAddsNoChannel) {
  const int w = world_size();
  auto g = ProcessGrid::create_mpi(GridShape{.dp = w}, kOpts);
  EXPECT_EQ(g->ep().size(), 1);
  EXPECT_EQ(&g->expert_dp(), &g->dp_grads());
  auto single = ProcessGrid::single();
  EXPECT_EQ(single->ep().size(), 1);
  EXPECT_EQ(single->expert_dp().size(), 1);
  EXPECT_EQ(single->ep().name(), "ep");
  EXPECT_EQ(single->expert_dp().name(), "expert_dp");
}

TEST(EpGridMpi, EpNotDividingDpIsOneConfigLine) {
  const int w = world_size();
  // dp = w; ep = w + 1 never divides it, nor 0.
  expect_error([&] { ProcessGrid::create_mpi(GridShape{.dp = w, .ep = w + 1}, kOpts); }, ErrorKind::Config,
               {str_cat("parallel.ep = ", w + 1, " must be at least 1 and divide parallel.dp = ", w)});
  expect_error([&] { ProcessGrid::create_mpi(GridShape{.dp = w, .ep = 0}, kOpts); }, ErrorKind::Config,
               {"parallel.ep = 0 must be at least 1"});
  if (w % 2 == 0)  // dp = w / 2 with tp = 2: ep = w does not divide it
    expect_error([&] { ProcessGrid::create_mpi(GridShape{.dp = w / 2, .tp = 2, .ep = w}, kOpts); }, ErrorKind::Config,
                 {str_cat("divide parallel.dp = ", w / 2)});
  // Nothing collective happened: a good grid follows.
  auto g = ProcessGrid::create_mpi(GridShape{.dp = w, .ep = w}, kOpts);
  check_ep_groups(*g, GridShape{.dp = w, .ep = w});
}

// An exchange over the grid's ep group moves rows between its members only.
TEST(EpGridMpi, AllToAllOverTheEpGroup) {
  const int w = world_size();
  if (w % 2 != 0) GTEST_SKIP() << "needs an even world";
  const GridShape s{.dp = w, .ep = 2};
  auto g = ProcessGrid::create_mpi(s, kOpts);
  Communicator& ep = g->ep();
  // Each rank sends its world rank + 1 to both members, one row each.
  std::vector<float> out(2, float(world_rank() + 1)), in(2, -1);
  const std::vector<int64_t> ones = {1, 1};
  ep.all_to_all_v(Tensor(out.data(), {2}, DType::F32), ones, Tensor(in.data(), {2}, DType::F32), ones);
  const int first = world_rank() - world_rank() % 2;
  EXPECT_EQ(in, (std::vector<float>{float(first + 1), float(first + 2)}));
}

}  // namespace
}  // namespace xirang::test
