#include "comm/mpi_runtime.h"

#include <mpi.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/mpi_check.h"
#include "core/error.h"

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

NodeLayout world_node_layout() {
  int world_rank = 0;
  XR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPI_Comm node = MPI_COMM_NULL;
  XR_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node));
  NodeLayout at;
  int rc_rank = MPI_Comm_rank(node, &at.local_rank);
  int rc_size = MPI_Comm_size(node, &at.local_size);
  // The CPUs this node's ranks may use: the union of their affinity masks
  // (a batch system's cpuset, or each rank's binding by mpirun).
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) CPU_SET(0, &mine);
  constexpr int kWords = int(sizeof(cpu_set_t) / sizeof(uint64_t));
  uint64_t words[kWords], all[kWords];
  std::memcpy(words, &mine, sizeof words);
  int rc_cpus = MPI_Allreduce(words, all, kWords, MPI_UINT64_T, MPI_BOR, node);
  MPI_Comm_free(&node);
  XR_MPI_CHECK(rc_rank);
  XR_MPI_CHECK(rc_size);
  XR_MPI_CHECK(rc_cpus);
  cpu_set_t any;
  std::memcpy(&any, all, sizeof any);
  at.node_cpus = CPU_COUNT(&any);
  // One rank per node counts it; the extremes of the per-node counts show an uneven placement.
  int leader = at.local_rank == 0 ? 1 : 0;
  XR_MPI_CHECK(MPI_Allreduce(&leader, &at.nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  XR_MPI_CHECK(MPI_Allreduce(&at.local_size, &at.min_per_node, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  XR_MPI_CHECK(MPI_Allreduce(&at.local_size, &at.max_per_node, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  int fits = at.node_cpus >= at.local_size ? 1 : 0, all_fit = 0;
  XR_MPI_CHECK(MPI_Allreduce(&fits, &all_fit, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  at.ranks_fit_cpus = all_fit == 1;
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
