#include "comm/mpi_runtime.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "comm/mpi_check.h"
#include "core/error.h"
#include "core/host_cpus.h"

namespace xirang {

namespace {
// Whether this process's MPI_Init_thread was ours. A process-wide flag because
// MPI initialisation is process-wide: an embedding program (or a test harness)
// that initialised MPI itself keeps the duty to finalise it.
std::atomic<bool> g_we_initialised{false};

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}
}  // namespace

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return str_cat("MPI error code ", code);
  return str_cat(std::string(text, size_t(len)), " (MPI error code ", code, ")");
}

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int initialised = 0;
  XR_MPI_CHECK(MPI_Initialized(&initialised));
  int provided = MPI_THREAD_SINGLE;
  if (initialised) {
    XR_MPI_CHECK(MPI_Query_thread(&provided));
  } else {
    XR_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
    if (provided < MPI_THREAD_MULTIPLE) {
      // Finalise before throwing: the destructor never runs for a throwing
      // constructor, and a rank that exits unfinalised makes mpirun report a crash.
      MPI_Finalize();
    } else {
      g_we_initialised = true;
    }
  }
  if (provided < MPI_THREAD_MULTIPLE)
    fail(ErrorKind::Comm, "MPI provides only ", thread_level_name(provided),
         " but Xirang needs MPI_THREAD_MULTIPLE (communication threads call MPI beside the compute thread); "
         "use an MPI library built with thread support");
  XR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  XR_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
}

NodeLayout world_node_layout(int compute_threads) {
  int world_rank = 0;
  XR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPI_Comm node = MPI_COMM_NULL;
  XR_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node));
  NodeLayout at;
  // The node's CPUs: the union of its ranks' affinity masks (a batch
  // system's cpuset, mpirun's binding), capped by the smallest CPU quota;
  // its compute threads: the sum of theirs. Every call below is made by
  // every rank of the node, errors checked after the node is freed.
  std::vector<uint64_t> mine = affinity_words();
  int words = int(mine.size()), max_words = 0, quota = cgroup_cpu_quota(), min_quota = 0;
  const int threads = std::max(1, compute_threads);
  int rc[7];
  rc[0] = MPI_Comm_rank(node, &at.local_rank);
  rc[1] = MPI_Comm_size(node, &at.local_size);
  // Which world ranks share the node (the split's key keeps them in world order).
  at.node_ranks.assign(size_t(std::max(1, at.local_size)), world_rank);
  rc[6] = MPI_Allgather(&world_rank, 1, MPI_INT, at.node_ranks.data(), 1, MPI_INT, node);
  rc[2] = MPI_Allreduce(&words, &max_words, 1, MPI_INT, MPI_MAX, node);
  mine.resize(size_t(std::max(words, max_words)), 0);
  std::vector<uint64_t> all(mine.size(), 0);
  rc[3] = MPI_Allreduce(mine.data(), all.data(), int(mine.size()), MPI_UINT64_T, MPI_BOR, node);
  if (quota <= 0) quota = INT32_MAX;
  rc[4] = MPI_Allreduce(&quota, &min_quota, 1, MPI_INT, MPI_MIN, node);
  rc[5] = MPI_Allreduce(&threads, &at.node_threads, 1, MPI_INT, MPI_SUM, node);
  MPI_Comm_free(&node);
  for (int r : rc) XR_MPI_CHECK(r);
  at.node_cpus = std::max(1, std::min(count_cpus(all), min_quota));
  // One rank per node counts it; the extremes of the per-node counts show an uneven placement.
  int leader = at.local_rank == 0 ? 1 : 0;
  XR_MPI_CHECK(MPI_Allreduce(&leader, &at.nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  XR_MPI_CHECK(MPI_Allreduce(&at.local_size, &at.min_per_node, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  XR_MPI_CHECK(MPI_Allreduce(&at.local_size, &at.max_per_node, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  int crowded_leader = leader && at.crowded() ? 1 : 0;
  XR_MPI_CHECK(MPI_Allreduce(&crowded_leader, &at.crowded_nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  // The most crowded node (the most threads over its CPUs), for messages: its counts from its lowest rank.
  struct {
    int excess, rank;
  } me{at.node_threads - at.node_cpus, world_rank}, worst{};
  XR_MPI_CHECK(MPI_Allreduce(&me, &worst, 1, MPI_2INT, MPI_MAXLOC, MPI_COMM_WORLD));
  int counts[3] = {at.local_size, at.node_threads, at.node_cpus};
  XR_MPI_CHECK(MPI_Bcast(counts, 3, MPI_INT, worst.rank, MPI_COMM_WORLD));
  at.worst_ranks = counts[0];
  at.worst_threads = counts[1];
  at.worst_cpus = counts[2];
  return at;
}

MpiRuntime::~MpiRuntime() {
  if (g_we_initialised.exchange(false) && active()) MPI_Finalize();
}

void MpiRuntime::abort_world(int code) {
  // MPI_Abort kills the process without running exit handlers, so buffered
  // output (the error line that explains the abort) would be lost.
  std::fflush(stdout);
  std::fflush(stderr);
  if (active()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; without MPI there is no job to end but ours
}

bool MpiRuntime::active() {
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  return initialised && !finalised;
}

}  // namespace xirang
