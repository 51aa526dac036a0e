// Latency of Xirang's MPI channels against blocking MPI calls, in one run.
//
//   mpirun -np 2 --oversubscribe build/bin/comm_latency_bench [--rounds 15] [--iters 100]
//
// For each size (16 bytes to 1 MiB of floats) two operations: an all-reduce
// (sum) over the world, and a ping-pong (rank 0 sends, rank 1 sends it back;
// half the round trip is reported). Each is made with blocking MPI calls on
// MPI_COMM_WORLD (MPI_Allreduce, MPI_Send/MPI_Recv: the peer, what MPI gives
// a thread that calls it directly) and through a channel of the process grid
// (all_reduce_async / send_async / recv_async, then wait: what the trainer
// pays, the worker thread's hand-offs included). The two alternate in rounds
// of --iters operations; the table gives the median of the rounds' means and
// the ratio channel / MPI (1.0 = no cost over MPI).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/clock.h"
#include "core/omp_wait.h"

using namespace xirang;
using xirang::bench::median;

namespace {

struct Options {
  int rounds = 15, iters = 100;
};

// Mean seconds per operation of `iters` calls of `op`, all ranks starting together.
template <class Op>
double timed(int iters, Op op) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = now_seconds();
  for (int i = 0; i < iters; ++i) op();
  double dt = (now_seconds() - t0) / iters, worst = 0;
  MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  restart_with_passive_omp_wait(argv);
  MpiRuntime mpi(&argc, &argv);
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rounds") o.rounds = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--iters") o.iters = std::max(1, std::atoi(argv[i + 1]));
  }
  const int rank = mpi.world_rank(), world = mpi.world_size();
  if (world != 2) {
    if (rank == 0) std::fprintf(stderr, "comm_latency_bench: run it on 2 ranks (mpirun -np 2), not %d\n", world);
    return 2;
  }
  auto grid = ProcessGrid::create_mpi(GridShape{2, 1, 1}, CommOptions{.timeout_s = 120}, LinkModel{});
  Communicator& ch = grid->world();
  if (rank == 0)
    std::printf("%-10s %-10s %12s %12s %8s\n", "operation", "bytes", "MPI us", "channel us", "ratio");
  for (const int64_t n : {int64_t(4), int64_t(4096), int64_t(65536), int64_t(262144)}) {
    std::vector<float> a(size_t(n), 1.f), b(size_t(n), 0.f);
    Tensor ta(a.data(), Shape{n}, DType::F32), tb(b.data(), Shape{n}, DType::F32);
    const int peer = 1 - rank, count = int(n);
    std::vector<double> mpi_ar, ch_ar, mpi_pp, ch_pp;
    for (int r = 0; r < o.rounds; ++r) {
      mpi_ar.push_back(timed(o.iters, [&] {
        MPI_Allreduce(a.data(), b.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }));
      ch_ar.push_back(timed(o.iters, [&] { ch.all_reduce_async(ta, ReduceOp::Sum)->wait(); }));
      // Half a round trip: rank 0 sends first and receives the echo.
      mpi_pp.push_back(timed(o.iters, [&] {
        if (rank == 0) {
          MPI_Send(a.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD);
          MPI_Recv(b.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
          MPI_Recv(b.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          MPI_Send(b.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD);
        }
      }) / 2);
      ch_pp.push_back(timed(o.iters, [&] {
        if (rank == 0) {
          WorkPtr s = ch.send_async(ta, peer, 7);
          ch.recv_async(tb, peer, 7)->wait();
          s->wait();
        } else {
          ch.recv_async(tb, peer, 7)->wait();
          ch.send_async(tb, peer, 7)->wait();
        }
      }) / 2);
    }
    if (rank == 0) {
      const double m1 = median(mpi_ar) * 1e6, c1 = median(ch_ar) * 1e6;
      const double m2 = median(mpi_pp) * 1e6, c2 = median(ch_pp) * 1e6;
      std::printf("%-10s %-10lld %12.1f %12.1f %8.2f\n", "all_reduce", (long long)(n * 4), m1, c1, c1 / m1);
      std::printf("%-10s %-10lld %12.1f %12.1f %8.2f\n", "ping_pong", (long long)(n * 4), m2, c2, c2 / m2);
    }
  }
  return 0;
}
