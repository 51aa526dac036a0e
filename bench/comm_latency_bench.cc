// Latency of Xirang's MPI channels against blocking MPI calls, in one run.
//
//   mpirun -np 2 build/bin/comm_latency_bench [--rounds 15] [--iters 100]
//
// For each size (16 bytes to 1 MiB of floats) two operations: an in-place
// all-reduce (max, so the values stay put) over the world, and a ping-pong (rank 0 sends, rank 1
// sends it back; half the round trip is reported). Each is made three ways:
// with blocking MPI calls on MPI_COMM_WORLD (MPI_Allreduce, MPI_Send/
// MPI_Recv: the peer, what MPI gives a thread that calls it directly), and
// through two channels (all_reduce_async / send_async / recv_async, then
// wait: what the trainer pays, the worker thread's hand-offs included), one
// with CommOptions::busy_poll Off and one On. The three alternate in rounds
// of --iters operations; a round's time is the slowest rank's mean, and the
// table gives the median over rounds and each channel's ratio to MPI (1.0 =
// no cost over MPI). The first line says what busy_poll=auto would choose
// here (ProcessGrid::create_mpi).
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_runtime.h"
#include "core/clock.h"
#include "core/omp_wait.h"

using namespace xirang;
using xirang::bench::median;

namespace {

// Mean seconds per operation of `iters` calls of `op` on the slowest rank, all starting together.
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
  int rounds = 15, iters = 100;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rounds") rounds = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--iters") iters = std::max(1, std::atoi(argv[i + 1]));
  }
  const int rank = mpi.world_rank(), world = mpi.world_size();
  if (world != 2) {
    if (rank == 0) std::fprintf(stderr, "comm_latency_bench: run it on 2 ranks (mpirun -np 2), not %d\n", world);
    return 2;
  }
  const NodeLayout at = world_node_layout(omp_get_max_threads());
  MpiCommunicator off(MPI_COMM_WORLD, "busy_poll_off", CommOptions{.timeout_s = 120, .busy_poll = BusyPoll::Off});
  MpiCommunicator on(MPI_COMM_WORLD, "busy_poll_on", CommOptions{.timeout_s = 120, .busy_poll = BusyPoll::On});
  if (rank == 0) {
    std::printf("this node: %d ranks, %d compute threads, %d CPUs: busy_poll=auto would be %s\n", at.local_size,
                at.node_threads, at.node_cpus, at.crowded() ? "off" : "on");
    std::printf("%-10s %-8s %9s %11s %11s %9s %9s\n", "operation", "bytes", "MPI us", "off us", "on us", "off/MPI",
                "on/MPI");
  }
  for (const int64_t n : {int64_t(4), int64_t(4096), int64_t(65536), int64_t(262144)}) {
    std::vector<float> a(size_t(n), 1.f), b(size_t(n), 0.f);
    Tensor ta(a.data(), Shape{n}, DType::F32), tb(b.data(), Shape{n}, DType::F32);
    const int peer = 1 - rank, count = int(n);
    std::vector<double> ar[3], pp[3];
    for (int r = 0; r < rounds; ++r) {
      ar[0].push_back(timed(iters, [&] { MPI_Allreduce(MPI_IN_PLACE, a.data(), count, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD); }));
      // Half a round trip: rank 0 sends first and receives the echo.
      pp[0].push_back(timed(iters, [&] {
        if (rank == 0) {
          MPI_Send(a.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD);
          MPI_Recv(b.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
          MPI_Recv(b.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          MPI_Send(b.data(), count, MPI_FLOAT, peer, 7, MPI_COMM_WORLD);
        }
      }) / 2);
      int k = 1;
      for (MpiCommunicator* ch : {&off, &on}) {
        ar[k].push_back(timed(iters, [&] { ch->all_reduce_async(ta, ReduceOp::Max)->wait(); }));
        pp[k].push_back(timed(iters, [&] {
          if (rank == 0) {
            WorkPtr s = ch->send_async(ta, peer, 7);
            ch->recv_async(tb, peer, 7)->wait();
            s->wait();
          } else {
            ch->recv_async(tb, peer, 7)->wait();
            ch->send_async(tb, peer, 7)->wait();
          }
        }) / 2);
        ++k;
      }
    }
    if (rank == 0)
      for (auto [name, t] : {std::pair{"all_reduce", ar}, std::pair{"ping_pong", pp}}) {
        const double m = median(t[0]) * 1e6, f = median(t[1]) * 1e6, o = median(t[2]) * 1e6;
        std::printf("%-10s %-8lld %9.1f %11.1f %11.1f %9.2f %9.2f\n", name, (long long)(n * 4), m, f, o, f / m, o / m);
      }
  }
  return 0;
}
