// Measured pipeline bubble against the simulator's prediction, in one run.
//
//   mpirun -np P --oversubscribe build/bin/pipeline_bench [--schedule 1f1b] [--steps 4] [--micro 1,2,4,8,16]
//
// Trains an 8-layer, d_model 256 GPT-2 split into P stages for each
// microbatch count m. Per rank and step it takes the pipeline part of the
// step (forward + backward + waiting for neighbours + waiting for its own
// sends) and reports the bubble as the waiting-for-neighbours share of it,
// averaged over ranks (median over the steps after the first). Next to it:
// the simulator's bubble for the same schedule with the forward and backward
// times measured per microbatch in that run, and the analytic value.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <sstream>
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
#include "runtime/step/schedule.h"
#include "runtime/trainer.h"

using namespace xirang;

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  MpiRuntime mpi(&argc, &argv);
  const int rank = mpi.world_rank(), p = mpi.world_size();
  std::string schedule = "1f1b", micro = "1,2,4,8,16";
  int steps = 4;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--schedule" && i + 1 < argc) schedule = argv[++i];
    else if (a == "--steps" && i + 1 < argc) steps = std::stoi(argv[++i]);
    else if (a == "--micro" && i + 1 < argc) micro = argv[++i];
    else {
      if (rank == 0) std::fprintf(stderr, "usage: pipeline_bench [--schedule S] [--steps N] [--micro 1,2,4]\n");
      return 2;
    }
  }
  try {
    namespace fs = std::filesystem;
    const std::string dir = (fs::temp_directory_path() / "xirang_pipeline_bench").string();
    if (rank == 0) {
      fs::remove_all(dir);
      bench::write_random_tokens(dir + "/train", "bytes", 256, 1 << 18, 5);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const int v = schedule == "interleaved" ? 2 : 1;
    if (rank == 0)
      std::printf("pp=%d, schedule %s (v=%d); bubble = share of the pipeline time spent waiting for neighbours\n"
                  "| m | measured | simulated (measured per-stage costs) | analytic (equal stages) | mean forward ms/mb | mean backward ms/mb |\n"
                  "|---|---|---|---|---|---|\n",
                  p, schedule.c_str(), v);
    std::stringstream ms(micro);
    std::string item;
    while (std::getline(ms, item, ',')) {
      const int m = std::stoi(item);
      if (schedule == "interleaved" && m % p != 0) continue;
      Config c = load_config(std::string(XIRANG_BENCH_CONFIG_DIR) + "/gpt2_debug.yaml",
                             {"model.d_model=256", "model.seq_len=128", "train.micro_batch=2",
                              "train.global_batch=" + std::to_string(2 * m), "train.steps=" + std::to_string(steps),
                              "parallel.pp=" + std::to_string(p), "parallel.schedule=" + schedule,
                              "parallel.virtual_stages=" + std::to_string(v), "data.train=" + dir + "/train",
                              "metrics.jsonl="});
      validate(c, p);
      auto grid = ProcessGrid::create_mpi(GridShape{1, 1, p}, comm_options(c));
      TrainerOptions o;
      o.print = false;
      o.peak = PeakFlops{1e11, "bench"};
      Trainer t(c, o, grid.get());
      TrainResult r = t.run();
      std::vector<double> frac, fwd, bwd;
      for (size_t i = 1; i < r.steps.size(); ++i) {
        const StepMetrics& s = r.steps[i];
        const double pipe = s.forward_ms + s.backward_ms + s.pp_bubble_ms + s.pp_comm_exposed_ms + s.data_wait_ms;
        frac.push_back(s.pp_bubble_ms / pipe);
        fwd.push_back(s.forward_ms / m);
        bwd.push_back(s.backward_ms / m);
      }
      double mine[3] = {bench::median(frac), bench::median(fwd), bench::median(bwd)};
      std::vector<double> all(size_t(3 * p));
      MPI_Gather(mine, 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      if (rank == 0) {
        // Each stage's own forward and backward times go into the simulator.
        SimCosts costs;
        double sum[3] = {0, 0, 0};
        for (int r = 0; r < p; ++r) {
          costs.forward_per_rank.push_back(all[size_t(3 * r + 1)]);
          costs.backward_per_rank.push_back(all[size_t(3 * r + 2)]);
          for (int k = 0; k < 3; ++k) sum[k] += all[size_t(3 * r + k)];
        }
        const double f = sum[1] / p, b = sum[2] / p;
        const ScheduleKind kind = parse_schedule(schedule, "--schedule");
        const SimResult sim = simulate(kind, p, m, v, costs);
        std::printf("| %d | %.3f | %.3f | %.3f | %.1f | %.1f |\n", m, sum[0] / p, sim.bubble_fraction,
                    analytic_bubble(kind, p, m, v), f, b);
        std::fflush(stdout);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) std::filesystem::remove_all(dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "pipeline_bench: rank %d: %s: %s\n", rank, error_kind_name(e.kind()), e.what());
    MpiRuntime::abort_world(1);
  }
  return 0;
}
