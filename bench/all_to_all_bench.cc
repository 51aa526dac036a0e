// Expert parallelism's token exchange on MPI channels: all_to_all_v against
// an all-gather of the same tokens, in one run.
//
//   mpirun -np 4 build/bin/all_to_all_bench [--rounds 7] [--iters 10] [--d-model 1024]
//
// Each rank holds T tokens of d_model floats and sends each to one rank of
// the group, chosen at random (uneven counts, exchanged first as the layer
// would). The all-to-all-v moves each token once; the all-gather
// dispatcher's alternative (Megatron's "allgather" token dispatcher) gives
// every rank every token, and each keeps the ones for its own experts: p
// times the bytes received. Both go through an MpiCommunicator (the worker
// thread's hand-offs included), alternating in rounds of --iters; a round's
// time is the slowest rank's mean, the table the median over rounds and
// the ratio all_to_all_v / all_gather (below 1: the all-to-all is cheaper).
// The counts exchange is timed on its own (it precedes every dispatch).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_runtime.h"
#include "core/clock.h"
#include "core/rng.h"

using namespace xirang;
using xirang::bench::median;

namespace {

// Mean seconds per call of `iters` calls of `op` on the slowest rank, all starting together.
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
  MpiRuntime mpi(&argc, &argv);
  int rounds = 7, iters = 10;
  int64_t d_model = 1024;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rounds") rounds = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--iters") iters = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--d-model") d_model = std::max(1, std::atoi(argv[i + 1]));
  }
  const int rank = mpi.world_rank(), p = mpi.world_size();
  MpiCommunicator ep(MPI_COMM_WORLD, "ep", CommOptions{.timeout_s = 120});
  if (rank == 0)
    std::printf("all_to_all_v vs all_gather of the same tokens: %d ranks, d_model %lld fp32, median of %d rounds x %d\n"
                "%8s %10s %12s %12s %12s %8s\n", p, static_cast<long long>(d_model), rounds, iters, "tokens",
                "MiB/rank", "counts us", "a2a_v us", "gather us", "ratio");
  for (int64_t tokens : {64, 512, 4096}) {
    // Each token to a random rank: the uneven counts of a router.
    std::vector<int64_t> send_counts(static_cast<size_t>(p), 0);
    for (int64_t t = 0; t < tokens; ++t) ++send_counts[size_t(rng_below(11, uint64_t(rank), uint64_t(t), uint64_t(p)))];
    const std::vector<int64_t> recv_counts = ep.exchange_counts(send_counts);
    int64_t in_rows = 0;
    for (int64_t c : recv_counts) in_rows += c;
    std::vector<float> send(size_t(tokens * d_model), 1.0f), recv(size_t(std::max<int64_t>(in_rows, 1) * d_model));
    std::vector<float> gathered(size_t(p * tokens * d_model));
    const Tensor ts(send.data(), {tokens, d_model}, DType::F32), tr(recv.data(), {in_rows, d_model}, DType::F32);
    const Tensor tg(gathered.data(), {int64_t(p) * tokens * d_model}, DType::F32);
    std::vector<double> counts_s, a2a_s, gather_s;
    for (int r = 0; r < rounds; ++r) {
      counts_s.push_back(timed(iters, [&] { ep.exchange_counts(send_counts); }));
      a2a_s.push_back(timed(iters, [&] { ep.all_to_all_v(ts, send_counts, tr, recv_counts); }));
      gather_s.push_back(timed(iters, [&] { ep.all_gather(ts.flat(), tg); }));
    }
    const double c = median(counts_s), a = median(a2a_s), g = median(gather_s);
    if (rank == 0)
      std::printf("%8lld %10.2f %12.1f %12.1f %12.1f %8.2f\n", static_cast<long long>(tokens),
                  double(tokens * d_model * 4) / (1 << 20), 1e6 * c, 1e6 * a, 1e6 * g, a / g);
  }
  return 0;
}
