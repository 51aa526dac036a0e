// comm/mpi_runtime.h: process-wide MPI set-up.
//
// One MpiRuntime lives in main() of a multi-rank program. It initialises MPI
// with MPI_THREAD_MULTIPLE (communication threads run beside the compute
// thread) and finalises it on destruction. After an unrecoverable error
// (a timed-out collective, a dead peer) the program calls abort_world(),
// which ends every rank of the job instead of leaving them hanging.
// node_layout() says how the launcher (mpirun, srun) spread the ranks over
// nodes, as MPI sees it rather than as any launcher's variables claim.
//
//   MpiRuntime mpi(&argc, &argv);
//   NodeLayout at = mpi.node_layout();   // e.g. 2 nodes, 4 ranks on each
//   auto grid = ProcessGrid::create_mpi(shape, options);
#pragma once

#include <vector>

namespace xirang {

// The ranks of MPI_COMM_WORLD grouped by the node (shared-memory domain) they run on.
struct NodeLayout {
  int nodes = 1;         // nodes the job spans
  int local_rank = 0;    // this rank's index among its node's ranks (world order)
  int local_size = 1;    // ranks on this rank's node
  std::vector<int> node_ranks;  // (local_size) world ranks on this rank's node, ascending
  int min_per_node = 1;  // fewest and most ranks on any node: equal when the
  int max_per_node = 1;  //   launcher placed the same number on every node
  int node_cpus = 1;     // CPUs this rank's node's ranks may run on: the union of their affinity masks, capped by a CPU quota
  int node_threads = 1;  // compute threads those ranks run together (world_node_layout's argument, summed)
  int crowded_nodes = 0;  // nodes whose compute threads outnumber their CPUs
  // The most crowded node (threads over CPUs the largest; any node when none is): its ranks, threads and CPUs.
  int worst_ranks = 1, worst_threads = 1, worst_cpus = 1;
  bool crowded() const { return node_threads > node_cpus; }  // this rank's node
};

// The layout of MPI_COMM_WORLD's ranks; `compute_threads`: the threads
// this rank computes with (its OpenMP team). Collective over the world.
NodeLayout world_node_layout(int compute_threads = 1);

class MpiRuntime {
 public:
  // Throws ErrorKind::Comm when the library cannot give MPI_THREAD_MULTIPLE.
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }
  // Collective over MPI_COMM_WORLD (every rank must call it).
  NodeLayout node_layout(int compute_threads = 1) const { return world_node_layout(compute_threads); }
  // Ends every rank of the job with `code` (MPI_Abort on MPI_COMM_WORLD).
  [[noreturn]] static void abort_world(int code);
  // True when MPI has been initialised and not finalised in this process.
  static bool active();

 private:
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace xirang
