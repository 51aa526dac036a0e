// Tests of the process grid: the rank <-> coordinates mapping, the
// single-rank grid, and over MPI every dp x cp x tp x pp factorisation of
// the world size, checking each group's members by a sum of world ranks and
// each rank's place in its groups.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/host_cpus.h"
#include "tests/mpi/mpi_test_util.h"

namespace xirang::test {
namespace {

std::string shape_str(const GridShape& s) { return str_cat("dp=", s.dp, " cp=", s.cp, " tp=", s.tp, " pp=", s.pp); }

TEST(GridMath, CoordinatesRoundTripWithTpFastestThenCpThenDpThenPp) {
  for (GridShape s : {GridShape{1, 1, 1}, GridShape{4, 1, 1}, GridShape{1, 4, 1}, GridShape{1, 1, 4},
                      GridShape{2, 2, 1}, GridShape{3, 2, 2}, GridShape{2, 4, 3}, GridShape{5, 1, 3},
                      GridShape{1, 1, 1, 4}, GridShape{2, 1, 1, 2}, GridShape{2, 2, 2, 3}, GridShape{3, 2, 1, 2}}) {
    SCOPED_TRACE(shape_str(s));
    for (int r = 0; r < s.world(); ++r) {
      GridCoords c = grid_coords(s, r);
      EXPECT_GE(c.dp, 0);
      EXPECT_LT(c.dp, s.dp);
      EXPECT_GE(c.tp, 0);
      EXPECT_LT(c.tp, s.tp);
      EXPECT_GE(c.pp, 0);
      EXPECT_LT(c.pp, s.pp);
      EXPECT_GE(c.cp, 0);
      EXPECT_LT(c.cp, s.cp);
      EXPECT_EQ(grid_rank(s, c), r);
      EXPECT_EQ(r, ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.tp + c.tp);
    }
  }
  // cp sits between tp and dp: dp2 x cp2 x tp2, rank 2 is cp 1, rank 4 is dp 1.
  const GridShape d{.dp = 2, .tp = 2, .pp = 1, .cp = 2};
  EXPECT_EQ(grid_coords(d, 2).cp, 1);
  EXPECT_EQ(grid_coords(d, 2).dp, 0);
  EXPECT_EQ(grid_coords(d, 4).cp, 0);
  EXPECT_EQ(grid_coords(d, 4).dp, 1);
  GridShape s{.dp = 2, .tp = 2, .pp = 2};
  GridCoords c1 = grid_coords(s, 1), c2 = grid_coords(s, 2), c4 = grid_coords(s, 4);
  EXPECT_EQ(c1.tp, 1);  // neighbours differ in tp first
  EXPECT_EQ(c1.dp, 0);
  EXPECT_EQ(c2.dp, 1);
  EXPECT_EQ(c2.tp, 0);
  EXPECT_EQ(c4.pp, 1);
  EXPECT_EQ(c4.dp, 0);
}

// A tp group is tp consecutive world ranks starting at a multiple of tp
// (what lets a launcher's consecutive placement keep it inside a node), in
// tp index order, and every member of it names the same group.
TEST(GridMath, TpGroupIsConsecutiveRanks) {
  for (GridShape s : {GridShape{1, 1, 1}, GridShape{2, 2, 1}, GridShape{3, 2, 2}, GridShape{2, 4, 3},
                      GridShape{2, 2, 2, 3}}) {
    SCOPED_TRACE(shape_str(s));
    for (int r = 0; r < s.world(); ++r) {
      const std::vector<int> group = tp_group_ranks(s, grid_coords(s, r));
      ASSERT_EQ(int(group.size()), s.tp);
      for (int t = 0; t < s.tp; ++t) EXPECT_EQ(group[size_t(t)], r - r % s.tp + t);
    }
  }
}

TEST(ProcessGridSingle, EveryGroupIsOneRank) {
  auto g = ProcessGrid::single();
  EXPECT_EQ(g->shape().world(), 1);
  EXPECT_EQ(g->world_rank(), 0);
  EXPECT_EQ(g->world().name(), "world");
  EXPECT_EQ(g->dp().name(), "dp");
  EXPECT_EQ(g->tp().name(), "tp");
  EXPECT_EQ(g->pp().name(), "pp");
  EXPECT_EQ(g->dp_grads().name(), "dp_grads");
  EXPECT_EQ(g->cp().name(), "cp");
  EXPECT_EQ(g->dp_cp().name(), "dp_cp");
  EXPECT_EQ(g->coords().cp, 0);
  EXPECT_EQ(g->shape().cp, 1);
  for (Communicator* c : {&g->world(), &g->dp(), &g->tp(), &g->pp(), &g->cp(), &g->dp_cp(), &g->dp_grads()}) {
    EXPECT_EQ(c->size(), 1);
    EXPECT_EQ(c->rank(), 0);
    EXPECT_EQ(c->all_reduce_sum(3.5), 3.5);
  }
}

// Sum of the world ranks of the members of this rank's group along one axis.
double group_rank_sum(const GridShape& s, GridCoords c, int GridCoords::*axis, int axis_size) {
  double sum = 0;
  for (int k = 0; k < axis_size; ++k) {
    c.*axis = k;
    sum += grid_rank(s, c);
  }
  return sum;
}

// The same over the dp x cp ranks of this rank's (tp, pp) position.
double dp_cp_rank_sum(const GridShape& s, GridCoords c) {
  double sum = 0;
  for (int d = 0; d < s.dp; ++d) {
    c.dp = d;
    sum += group_rank_sum(s, c, &GridCoords::cp, s.cp);
  }
  return sum;
}

// The group's world ranks in the order of its ranks (an all-reduce of
// one-hot rows), so that membership and order are both checked.
std::vector<double> members(Communicator& group, int world_rank) {
  std::vector<double> rows(size_t(group.size()), 0.0);
  rows[size_t(group.rank())] = world_rank;
  group.all_reduce(Tensor(rows.data(), {int64_t(rows.size())}, DType::F64), ReduceOp::Sum);
  return rows;
}

void check_grid(ProcessGrid& g, const GridShape& s) {
  int w = world_rank();
  EXPECT_EQ(g.world_rank(), w);
  GridCoords c = g.coords(), want = grid_coords(s, w);
  EXPECT_EQ(c.dp, want.dp);
  EXPECT_EQ(c.tp, want.tp);
  EXPECT_EQ(c.pp, want.pp);
  EXPECT_EQ(c.cp, want.cp);
  EXPECT_EQ(g.world().size(), s.world());
  EXPECT_EQ(g.world().rank(), w);
  EXPECT_EQ(g.tp().size(), s.tp);
  EXPECT_EQ(g.tp().rank(), c.tp);
  EXPECT_EQ(g.dp().size(), s.dp);
  EXPECT_EQ(g.dp().rank(), c.dp);
  EXPECT_EQ(g.pp().size(), s.pp);
  EXPECT_EQ(g.pp().rank(), c.pp);
  EXPECT_EQ(g.cp().size(), s.cp);
  EXPECT_EQ(g.cp().rank(), c.cp);
  // Every copy of this rank's parameters, dp index then cp index.
  EXPECT_EQ(g.dp_cp().size(), s.dp * s.cp);
  EXPECT_EQ(g.dp_cp().rank(), c.dp * s.cp + c.cp);
  EXPECT_EQ(g.dp_grads().size(), s.dp * s.cp);
  EXPECT_EQ(g.dp_grads().rank(), c.dp * s.cp + c.cp);
  EXPECT_EQ(g.world().name(), "world");
  EXPECT_EQ(g.tp().name(), "tp");
  EXPECT_EQ(g.dp().name(), "dp");
  EXPECT_EQ(g.pp().name(), "pp");
  EXPECT_EQ(g.dp_grads().name(), "dp");
  EXPECT_EQ(g.cp().name(), "cp");
  EXPECT_EQ(g.dp_cp().name(), "dp_cp");
  // Every rank runs the same sequence of group collectives.
  EXPECT_EQ(g.world().all_reduce_sum(w), s.world() * (s.world() - 1) / 2.0);
  EXPECT_EQ(g.tp().all_reduce_sum(w), group_rank_sum(s, c, &GridCoords::tp, s.tp));
  EXPECT_EQ(g.dp().all_reduce_sum(w), group_rank_sum(s, c, &GridCoords::dp, s.dp));
  EXPECT_EQ(g.pp().all_reduce_sum(w), group_rank_sum(s, c, &GridCoords::pp, s.pp));
  EXPECT_EQ(g.cp().all_reduce_sum(w), group_rank_sum(s, c, &GridCoords::cp, s.cp));
  EXPECT_EQ(g.dp_cp().all_reduce_sum(w), dp_cp_rank_sum(s, c));
  EXPECT_EQ(g.dp_grads().all_reduce_sum(w), dp_cp_rank_sum(s, c));
  std::vector<double> cp_want, dp_cp_want;
  for (int d = 0; d < s.dp; ++d)
    for (int k = 0; k < s.cp; ++k) {
      GridCoords at = c;
      at.dp = d;
      at.cp = k;
      dp_cp_want.push_back(grid_rank(s, at));
      if (d == c.dp) cp_want.push_back(grid_rank(s, at));
    }
  EXPECT_EQ(members(g.cp(), w), cp_want);
  EXPECT_EQ(members(g.dp_cp(), w), dp_cp_want);
  EXPECT_EQ(members(g.dp_grads(), w), dp_cp_want);
  // The bucket channel and the dp channel run at the same time without mixing.
  double a = w, b = 10.0 * w;
  WorkPtr wa = g.dp_grads().all_reduce_async(Tensor(&a, {1}, DType::F64), ReduceOp::Sum);
  WorkPtr wb = g.dp().all_reduce_async(Tensor(&b, {1}, DType::F64), ReduceOp::Max);
  wb->wait();
  wa->wait();
  EXPECT_EQ(a, dp_cp_rank_sum(s, c));
  GridCoords top = c;
  top.dp = s.dp - 1;
  EXPECT_EQ(b, 10.0 * grid_rank(s, top));
}

std::vector<GridShape> factorisations(int world) {
  std::vector<GridShape> out;
  for (int pp = 1; pp <= world; ++pp)
    for (int tp = 1; tp <= world; ++tp)
      for (int cp = 1; cp <= world; ++cp)
        if (world % (pp * tp * cp) == 0)
          out.push_back(GridShape{.dp = world / (pp * tp * cp), .tp = tp, .pp = pp, .cp = cp});
  return out;
}

TEST(ProcessGridMpi, EveryFactorisationOfTheWorld) {
  for (const GridShape& s : factorisations(world_size())) {
    SCOPED_TRACE(shape_str(s));
    auto g = ProcessGrid::create_mpi(s, kOpts);
    check_grid(*g, s);
  }
}

// With a link model every group is a SimulatedLink around an MpiCommunicator;
// results and names are the same.
TEST(ProcessGridMpi, WithSimulatedLink) {
  int w = world_size();
  GridShape s = w % 2 == 0 ? GridShape{.dp = w / 2, .tp = 2, .pp = 1} : GridShape{.dp = w, .tp = 1, .pp = 1};
  auto g = ProcessGrid::create_mpi(s, kOpts, LinkModel{.latency_us = 200, .bandwidth_gbps = 0});
  check_grid(*g, s);
}

TEST(ProcessGridMpi, MismatchedShapeIsAConfigError) {
  int w = world_size();
  GridShape s = w == 4 ? GridShape{.dp = 3, .tp = 1, .pp = 1} : GridShape{.dp = 2, .tp = 2, .pp = 1};
  expect_error([&] { ProcessGrid::create_mpi(s, kOpts); }, ErrorKind::Config,
               {str_cat("world size ", w, " does not match parallel.dp x cp x tp x pp = ", s.dp, " x 1 x ", s.tp, " x ",
                        s.pp, " = ", s.world())});
  expect_error([&] { ProcessGrid::create_mpi(GridShape{.dp = 1, .tp = 1, .pp = 1, .cp = 2 * w}, kOpts); },
               ErrorKind::Config, {str_cat("parallel.dp x cp x tp x pp = 1 x ", 2 * w, " x 1 x 1 = ", 2 * w)});
  expect_error([&] { ProcessGrid::create_mpi(GridShape{.dp = 0, .tp = w, .pp = 1}, kOpts); }, ErrorKind::Config,
               {"parallel.dp x cp x tp x pp = 0 x"});
  // Nothing collective happened on the failed attempts: a good grid follows.
  auto g = ProcessGrid::create_mpi(GridShape{.dp = w, .tp = 1, .pp = 1}, kOpts);
  check_grid(*g, GridShape{.dp = w, .tp = 1, .pp = 1});
}

// The CPUs of this (single) node's ranks: the union of their affinity
// masks (gathered here and OR-ed), within any CPU quota. Collective.
int node_cpus_reference() {
  const int w = world_size();
  std::vector<uint64_t> mine = affinity_words();
  int words = int(mine.size()), max_words = 0;
  MPI_Allreduce(&words, &max_words, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  mine.resize(size_t(max_words), 0);
  std::vector<uint64_t> every(mine.size() * size_t(w));
  MPI_Allgather(mine.data(), max_words, MPI_UINT64_T, every.data(), max_words, MPI_UINT64_T, MPI_COMM_WORLD);
  std::vector<uint64_t> any(mine.size(), 0);
  for (size_t i = 0; i < every.size(); ++i) any[i % mine.size()] |= every[i];
  int cpus = count_cpus(any);
  if (const int quota = cgroup_cpu_quota(); quota > 0) cpus = std::min(cpus, quota);
  return cpus;
}

std::string mode(BusyPoll b) { return b == BusyPoll::On ? "on" : b == BusyPoll::Off ? "off" : "auto"; }

// comm.busy_poll=auto: the grid's channels busy-poll where the node's
// compute threads fit its CPUs, and sleep between polls where they do not
// (the polls would take a CPU from the rank being waited for). A thousand
// threads per rank crowd any node; one per rank fits where there are as
// many CPUs as ranks (np2 on two CPUs), else it is crowded too. An explicit
// mode is kept either way.
TEST(ProcessGridMpi, AutoBusyPollIsOffOnACrowdedNodeAndOnElsewhere) {
  const int w = world_size(), cpus = node_cpus_reference();
  const GridShape s{.dp = w, .tp = 1, .pp = 1};
  for (const int threads : {1, 1000}) {
    SCOPED_TRACE(str_cat(threads, " threads per rank, ", w, " ranks, ", cpus, " CPUs"));
    CommOptions o = kOpts;
    o.compute_threads = threads;
    o.busy_poll = BusyPoll::Auto;
    const BusyPoll want = threads * w > cpus ? BusyPoll::Off : BusyPoll::On;
    EXPECT_EQ(mode(ProcessGrid::create_mpi(s, o)->busy_poll()), mode(want));
    for (const BusyPoll fixed : {BusyPoll::On, BusyPoll::Off}) {
      o.busy_poll = fixed;
      EXPECT_EQ(mode(ProcessGrid::create_mpi(s, o)->busy_poll()), mode(fixed));
    }
  }
  EXPECT_EQ(mode(ProcessGrid::single()->busy_poll()), "off");
}

// world_node_layout on one node: every rank is on it, the compute threads
// add up, the CPUs are the union of the ranks' affinity masks (gathered
// here and OR-ed as a reference) within any CPU quota, and a node is
// crowded exactly when its threads outnumber those CPUs.
TEST(NodeLayout, CountsTheNodesRanksThreadsAndCpus) {
  const int w = world_size(), r = world_rank();
  const int cpus = node_cpus_reference();

  for (const int threads : {1, 3, 1000}) {
    SCOPED_TRACE(threads);
    const NodeLayout at = world_node_layout(threads);
    EXPECT_EQ(at.nodes, 1);
    EXPECT_EQ(at.local_size, w);
    EXPECT_EQ(at.local_rank, r);
    std::vector<int> all(size_t(w), 0);
    for (int i = 0; i < w; ++i) all[size_t(i)] = i;
    EXPECT_EQ(at.node_ranks, all);
    EXPECT_EQ(at.min_per_node, w);
    EXPECT_EQ(at.max_per_node, w);
    EXPECT_EQ(at.node_threads, threads * w);
    EXPECT_EQ(at.node_cpus, cpus);
    EXPECT_EQ(at.crowded(), threads * w > cpus);
    EXPECT_EQ(at.crowded_nodes, at.crowded() ? 1 : 0);
    EXPECT_EQ(at.worst_ranks, w);
    EXPECT_EQ(at.worst_threads, threads * w);
    EXPECT_EQ(at.worst_cpus, cpus);
  }
}

}  // namespace
}  // namespace xirang::test
