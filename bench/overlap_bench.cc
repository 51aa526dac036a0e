// Data-parallel gradient reduction hidden behind the backward pass.
//
//   mpirun -np 2 --oversubscribe build/bin/overlap_bench [--steps 6] [--latency-us 100] [--bandwidth-gbps 0.25]
//
// Trains the same model twice in one MPI job over a link with injected
// latency and bandwidth (comm/simulated_link.h): once with each bucket's
// all-reduce launched as soon as its gradients are final during backward,
// once with every reduction launched after backward. Reports, per step
// (median over the steps after the first), the backward time, the time the
// reductions took, and the exposed time the step waited for them, and the
// ratio of exposed times (overlap on / off), which the project requires to
// be at most 25% when backward compute exceeds the reduction time.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/omp_wait.h"
#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/rng.h"
#include "runtime/comm_groups.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/trainer.h"

using namespace xirang;

namespace {

struct Row {
  double backward_ms, comm_ms, exposed_ms, step_ms;
};

}  // namespace

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  MpiRuntime mpi(&argc, &argv);
  const int rank = mpi.world_rank(), world = mpi.world_size();
  int steps = 6;
  double latency_us = 100, bandwidth = 0.25;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::stoi(argv[++i]);
    else if (a == "--latency-us" && i + 1 < argc) latency_us = std::stod(argv[++i]);
    else if (a == "--bandwidth-gbps" && i + 1 < argc) bandwidth = std::stod(argv[++i]);
    else {
      if (rank == 0) std::fprintf(stderr, "usage: overlap_bench [--steps N] [--latency-us X] [--bandwidth-gbps Y]\n");
      return 2;
    }
  }
  try {
    namespace fs = std::filesystem;
    const std::string dir = (fs::temp_directory_path() / "xirang_overlap_bench").string();
    if (rank == 0) {
      fs::remove_all(dir);
      bench::write_random_tokens(dir + "/train", "bytes", 256, 1 << 18, 3);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    Row rows[2];
    for (int overlap = 1; overlap >= 0; --overlap) {
      // 8 layers of width 256: about 6.4M parameters (25 MB of fp32
      // gradients) in 1 MB buckets; one microbatch of 4 x 128 tokens per rank.
      Config c = load_config(std::string(XIRANG_BENCH_CONFIG_DIR) + "/gpt2_debug.yaml",
                             {"model.d_model=256", "model.n_head=4", "model.seq_len=128", "train.micro_batch=4",
                              "train.global_batch=" + std::to_string(4 * world), "train.steps=" + std::to_string(steps),
                              "parallel.bucket_mb=1", "data.train=" + dir + "/train",
                              std::string("parallel.overlap_grad_reduce=") + (overlap ? "true" : "false"),
                              "comm.latency_us=" + std::to_string(latency_us),
                              "comm.bandwidth_gbps=" + std::to_string(bandwidth), "metrics.jsonl="});
      validate(c, world);
      auto grid = ProcessGrid::create_mpi(GridShape{c.parallel.dp, 1, 1}, comm_options(c),
                                          LinkModel{c.comm.latency_us, c.comm.bandwidth_gbps});
      TrainerOptions o;
      o.print = false;
      o.peak = PeakFlops{1e11, "bench"};
      Trainer t(c, o, grid.get());
      TrainResult r = t.run();
      std::vector<double> bw, cm, ex, st;
      for (size_t i = 1; i < r.steps.size(); ++i) {
        bw.push_back(r.steps[i].backward_ms);
        cm.push_back(r.steps[i].dp_comm_ms);
        ex.push_back(r.steps[i].dp_comm_exposed_ms);
        st.push_back(r.steps[i].step_ms);
      }
      rows[overlap] = {bench::median(bw), bench::median(cm), bench::median(ex), bench::median(st)};
    }
    if (rank == 0) {
      std::printf("dp=%d, link: %.0f us latency, %.2f GB/s; medians over steps 2..%d (rank 0)\n", world, latency_us,
                  bandwidth, steps);
      std::printf("| overlap | backward ms | dp comm ms | dp exposed ms | step ms |\n|---|---|---|---|---|\n");
      for (int overlap = 1; overlap >= 0; --overlap)
        std::printf("| %s | %.1f | %.1f | %.1f | %.1f |\n", overlap ? "on" : "off", rows[overlap].backward_ms,
                    rows[overlap].comm_ms, rows[overlap].exposed_ms, rows[overlap].step_ms);
      std::printf("exposed with overlap / without: %.1f%%\n", 100 * rows[1].exposed_ms / rows[0].exposed_ms);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) std::filesystem::remove_all(dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "overlap_bench: rank %d: %s: %s\n", rank, error_kind_name(e.kind()), e.what());
    MpiRuntime::abort_world(1);
  }
  return 0;
}
