// The cost of recording communication operations (comm/comm_trace.h): the
// ring's posted + started + completed per operation, in nanoseconds; and,
// under mpirun, an 8-byte all-reduce's time on a channel that records
// against one that does not (alternating blocks of the same channel pair,
// the median block of each).
//
//   build/bin/comm_trace_bench [--ops N]
//   mpirun -np 2 build/bin/comm_trace_bench [--ops N]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm_trace.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_runtime.h"
#include "core/clock.h"

using namespace xirang;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int ops = 1000000;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--ops")) ops = std::atoi(argv[i + 1]);
  {
    CommTrace t(0, 2, "");
    const int ch = t.add_channel("dp", 0, {0, 1});
    const double start = now_seconds();
    for (int i = 0; i < ops; ++i) {
      const uint64_t id = t.posted(ch, CommOpKind::AllReduce, -1, -1, 4096, uint64_t(i), now_seconds());
      t.started(id, now_seconds());
      t.completed(id, true, now_seconds());
    }
    std::printf("ring: %.1f ns per operation (posted + started + completed, with their clock reads; %d operations)\n",
                (now_seconds() - start) * 1e9 / ops, ops);
  }
  if (!std::getenv("OMPI_COMM_WORLD_SIZE")) return 0;
  MpiRuntime mpi(&argc, &argv);
  CommTrace trace(mpi.world_rank(), mpi.world_size(), "");
  MpiCommunicator plain(MPI_COMM_WORLD, "plain", CommOptions{.timeout_s = 60});
  MpiCommunicator traced(MPI_COMM_WORLD, "traced", CommOptions{.timeout_s = 60, .trace = &trace});
  const int blocks = 20, per_block = std::max(1, std::min(ops, 100000) / 100);
  std::vector<double> t_plain, t_traced;
  double x = 1;
  for (int b = 0; b < blocks; ++b)
    for (MpiCommunicator* c : {&plain, &traced}) {
      const double start = now_seconds();
      for (int i = 0; i < per_block; ++i) c->all_reduce(Tensor(&x, {1}, DType::F64), ReduceOp::Max);
      (c == &plain ? t_plain : t_traced).push_back((now_seconds() - start) * 1e6 / per_block);
    }
  if (mpi.world_rank() == 0)
    std::printf("8-byte all_reduce over %d ranks: %.2f us without the trace, %.2f us with it (median of %d blocks of %d)\n",
                mpi.world_size(), median(t_plain), median(t_traced), blocks, per_block);
  return 0;
}
