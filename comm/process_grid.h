// comm/process_grid.h: the dp x cp x tp x pp process grid and its groups.
//
// World rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index:
// tp varies fastest (tensor-parallel groups on neighbouring ranks, in one
// node), then cp (context parallelism gathers keys and values every layer,
// so it comes next on the fast links), then dp, then pp. Each rank belongs
// to one group of each kind; the grid owns a Communicator per group, plus a
// separate channel for gradient buckets so that bucket traffic never queues
// behind other operations. Parameters are replicated over cp as over dp, so
// gradients reduce over dp x cp: dp_grads() and dp_cp() span those ranks of
// one (tp, pp) position; with cp = 1 they are dp's ranks, as before cp.
//
// Expert parallelism lives inside dp (the world and the rank order do not
// change): ep must divide dp; the experts are sharded over ep consecutive dp
// indices of one (cp, tp, pp) position, the ep group (ep index = dp % ep).
// The ranks holding the same experts (same ep index) form the expert-dp
// group: dp / ep of them, times cp as for dp_grads(), over which expert
// gradients reduce, as dense ones reduce over dp_grads(). With ep = 1 the ep
// group is each rank alone and expert_dp() is dp_grads() itself.
//
//   dp=4 ep=2, tp=cp=pp=1: ep groups {0,1} {2,3}; expert-dp groups {0,2} {1,3}
//
//   GridShape shape{.dp = 2, .tp = 2, .pp = 1, .cp = 2};
//   auto grid = ProcessGrid::create_mpi(shape, CommOptions{.timeout_s = 60}, link);
//   grid->tp().all_reduce(partial, ReduceOp::Sum);
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/simulated_link.h"

namespace xirang {

// cp comes last in both structs so that positional {dp, tp, pp} stays what
// it was; ep after it, since it divides dp and adds no ranks.
struct GridShape {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int cp = 1;
  int ep = 1;  // expert parallelism: divides dp
  int world() const { return dp * cp * tp * pp; }
};

struct GridCoords {
  int dp = 0;
  int tp = 0;
  int pp = 0;
  int cp = 0;
};

int grid_rank(const GridShape& s, const GridCoords& c);
GridCoords grid_coords(const GridShape& s, int world_rank);
// The world ranks of the tensor-parallel group at `c` (tp index order):
// consecutive ranks, so a launcher that places each node's ranks
// consecutively keeps the group inside a node when tp divides its ranks.
std::vector<int> tp_group_ranks(const GridShape& s, const GridCoords& c);

class ProcessGrid {
 public:
  virtual ~ProcessGrid() = default;
  // One rank, no MPI: every group is a LocalCommunicator.
  static std::unique_ptr<ProcessGrid> single();
  // Over MPI_COMM_WORLD (MpiRuntime must be alive); the world size must equal
  // shape.world(), else ErrorKind::Config. When `link` injects latency,
  // bandwidth or faults, every group's communicator is wrapped in a SimulatedLink.
  // Every channel records its operations in one CommTrace (opts.trace, or
  // one the grid creates with opts.trace_dir), dumped on a timeout.
  static std::unique_ptr<ProcessGrid> create_mpi(const GridShape& shape, const CommOptions& opts,
                                                 const LinkModel& link = {});

  const GridShape& shape() const { return shape_; }
  const GridCoords& coords() const { return coords_; }
  int world_rank() const { return world_rank_; }
  virtual Communicator& world() = 0;
  // The ranks of this rank's (cp, tp, pp) position: one replica each of the same rows.
  virtual Communicator& dp() = 0;
  virtual Communicator& tp() = 0;
  virtual Communicator& pp() = 0;
  // The ranks of this rank's (dp, tp, pp) position, ordered by cp index: the
  // sequence's parts (keys and values are gathered over it).
  virtual Communicator& cp() = 0;
  // The ranks of this rank's (tp, pp) position, ordered by dp index then
  // cp index (rank in group = dp_index * cp + cp_index): every copy of this
  // rank's parameters, for host scalars (the loss, the gradient norm).
  virtual Communicator& dp_cp() = 0;
  // The channel for gradient buckets and ZeRO-1's shards (same ranks and
  // order as dp_cp()).
  virtual Communicator& dp_grads() = 0;
  // The first and the last pipeline stage of this rank's (dp, tp) position,
  // which hold the two copies of the tied token embedding (rank 0: first
  // stage, rank 1: last). A group of one on middle stages and when pp = 1.
  virtual Communicator& embedding() = 0;
  // The ep ranks of this rank's (cp, tp, pp) position and dp block
  // (dp indices [dp - dp % ep, + ep)), ordered by dp index: they share the
  // experts out and exchange tokens (all-to-all-v). A group of one when ep = 1.
  virtual Communicator& ep() = 0;
  // The ranks of this rank's (tp, pp) position and ep index (dp % ep), ordered
  // by dp / ep then cp index (rank in group = (dp / ep) * cp + cp_index):
  // every copy of this rank's experts, for their gradient buckets. With
  // ep = 1 it is dp_grads().
  virtual Communicator& expert_dp() = 0;
  // The record of this rank's recent operations (comm/comm_trace.h); null for single().
  virtual CommTrace* trace() { return nullptr; }
  // How this rank's MPI channels poll while waited on: CommOptions::busy_poll
  // as create_mpi resolved Auto for this rank's node (Off for single(), which has no channels).
  virtual BusyPoll busy_poll() const { return BusyPoll::Off; }

 protected:
  GridShape shape_;
  GridCoords coords_;
  int world_rank_ = 0;
};

}  // namespace xirang
