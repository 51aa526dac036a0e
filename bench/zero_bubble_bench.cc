// ZB-H1 against 1F1B on CPU ranks, in one run: the measured step and
// bubble of each schedule, the simulator's prediction from the measured
// stage times, and the activation memory each plans.
//
//   mpirun -np 2 --oversubscribe build/bin/zero_bubble_bench [--micro 6] [--rounds 5] [--steps 4]
//
// The model is gpt2_debug widened to d_model 256 (8 layers, sequence 128,
// microbatch 2) split into P stages. First each rank times its own stage
// alone, per microbatch: the forward (F), the input-gradient part of the
// backward (B) and its weight part (W), medians of `rounds` rounds after a
// warm-up, of which only W's share of a backward is used: the ranks share
// the machine's cores, so a stage alone is not timed as in training. Then
// the two schedules train in alternation,
// `rounds` runs each (the order switching every round, so both see the
// machine's noise alike), `steps` steps a run; a run's step time is its
// median over the steps after the first, and a schedule's the median over
// its runs. Each schedule's bubble (its pp_bubble_ms share of the pipeline
// time, rank mean) is printed beside the simulator's for its run's forward
// and backward times per microbatch (transfers free); the gain ZB-H1
// reaches beside the one the simulator predicts for 1F1B's stage times;
// and the memory plan's activations.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/clock.h"
#include "core/omp_wait.h"
#include "core/rng.h"
#include "runtime/comm_groups.h"
#include "runtime/config/model_layout.h"
#include "runtime/step/schedule.h"
#include "runtime/trainer.h"

using namespace xirang;

namespace {

Config bench_config(const std::string& data, int p, int m, int steps, const std::string& schedule) {
  Config c = load_config(std::string(XIRANG_BENCH_CONFIG_DIR) + "/gpt2_debug.yaml",
                         {"model.d_model=256", "model.seq_len=128", "train.micro_batch=2",
                          "train.global_batch=" + std::to_string(2 * m), "train.steps=" + std::to_string(steps),
                          "parallel.pp=" + std::to_string(p), "parallel.schedule=" + schedule,
                          "data.train=" + data, "data.val=", "train.eval_every=0", "metrics.jsonl="});
  validate(c, p);
  return c;
}

// This rank's stage alone: medians of F, B and W per microbatch, in ms.
struct StageTimes {
  double f = 0, b = 0, w = 0;
};

StageTimes time_stage(const Config& cfg, int p, int rank, int rounds) {
  const ModelDims& dims = cfg.model;
  const ChunkPlacement at = ChunkPlacement::of_chunk(dims.n_layer, p, rank);
  ChunkBatch batch = chunk_batch(cfg, 1);
  batch.split_backward = true;
  auto chunk = model_arch(dims.arch).make_chunk(dims, at, DType::F32, batch, {});
  Arena mp = Arena::measuring("p"), mg = Arena::measuring("g"), ma = Arena::measuring("a");
  chunk->layout_parameters(mp, mg);
  chunk->layout_activations(ma);
  Arena params("parameters", mp.used()), grads("gradients", mg.used()), acts("activations", ma.used());
  chunk->layout_parameters(params, grads);
  chunk->layout_activations(acts);
  chunk->init_parameters(cfg.train.seed);
  const int B = cfg.train.micro_batch, T = cfg.seq_len();
  std::vector<int32_t> tokens(size_t(B) * T), targets(size_t(B) * T);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t(rng_below(7, 1, i, uint64_t(dims.vocab_size)));
    targets[i] = int32_t(rng_below(7, 2, i, uint64_t(dims.vocab_size)));
  }
  const Tensor tok(tokens.data(), {B, T}, DType::I32), tgt(targets.data(), {B, T}, DType::I32);
  const KernelContext ctx;
  // Random stage boundaries (F32 on the CPU): the input a previous stage would send, the gradient a next one would.
  auto fill = [](Tensor t, uint64_t stream, float scale) {
    float* x = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) x[i] = scale * float(2 * rng_uniform(13, stream, uint64_t(i)) - 1);
  };
  Arena io("bench io", 2 * size_t(chunk->stage_output(0).bytes()) + 4096);
  Tensor out_grad;
  if (!at.has_head) {
    out_grad = io.alloc(chunk->stage_output(0).shape(), DType::F32, "output gradient");
    fill(out_grad, 1, 1e-3f);
  }
  if (!at.has_embedding) fill(chunk->stage_input(0), 2, 1.0f);
  std::vector<double> f, b, w;
  for (int r = 0; r <= rounds; ++r) {
    const double t0 = now_seconds();
    chunk->forward(ctx, 0, tok, tgt, 1.0 / double(B * T));
    const double t1 = now_seconds();
    chunk->backward(ctx, 0, tok, GradPhase::Final, out_grad, BackwardPart::InputGrad);
    const double t2 = now_seconds();
    chunk->backward(ctx, 0, tok, GradPhase::Final, out_grad, BackwardPart::WeightGrad);
    const double t3 = now_seconds();
    if (at.has_head) chunk->take_loss(ctx);
    if (r == 0) continue;  // first touches of the arenas
    f.push_back(1e3 * (t1 - t0));
    b.push_back(1e3 * (t2 - t1));
    w.push_back(1e3 * (t3 - t2));
  }
  return {bench::median(f), bench::median(b), bench::median(w)};
}

// One training run: the median step (ms) after the first, and the bubble's
// share of the pipeline time (median), on this rank.
struct RunTimes {
  double step_ms = 0, bubble = 0, forward_ms = 0, backward_ms = 0;  // the last two per microbatch
  size_t activations = 0;
};

RunTimes train(const Config& c, int p) {
  auto grid = ProcessGrid::create_mpi(GridShape{1, 1, p}, comm_options(c));
  TrainerOptions o;
  o.print = false;
  o.peak = PeakFlops{1e11, "bench"};
  Trainer t(c, o, grid.get());
  const TrainResult r = t.run();
  const int m = c.microbatches();
  std::vector<double> step, bubble, fwd, bwd;
  for (size_t i = 1; i < r.steps.size(); ++i) {
    const StepMetrics& s = r.steps[i];
    step.push_back(s.step_ms);
    bubble.push_back(s.pp_bubble_ms / (s.forward_ms + s.backward_ms + s.pp_bubble_ms + s.pp_comm_exposed_ms + s.data_wait_ms));
    fwd.push_back(s.forward_ms / m);
    bwd.push_back(s.backward_ms / m);
  }
  return {bench::median(step), bench::median(bubble), bench::median(fwd), bench::median(bwd),
          t.memory_plan().bytes_of("activations")};
}

}  // namespace

// The step's global synchronisation on its critical path. The rank that
// ends the schedule (stage 0: the last backward, then its W under ZB-H1)
// finds the other stages already waiting in the drain's barrier, so what
// the synchronisation adds to the step is the latency of that pp barrier,
// the gradient norm's pp sum and the guard's world vote (trainer.cc's
// drain_pipeline and optimizer_step), here back to back on aligned ranks
// through channels built as training builds them: the median, in µs.
double sync_latency_us(const Config& cfg, int p, int reps) {
  auto grid = ProcessGrid::create_mpi(GridShape{1, 1, p}, comm_options(cfg));
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    grid->pp().barrier();
    const double t0 = now_seconds();
    grid->pp().barrier();
    volatile double norm = grid->pp().all_reduce_sum(1.0);
    (void)norm;
    double votes[3] = {0, 0, 0};
    grid->world().all_reduce(Tensor(votes, {3}, DType::F64), ReduceOp::Max);
    us.push_back((now_seconds() - t0) * 1e6);
  }
  return bench::median(us);
}

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  MpiRuntime mpi(&argc, &argv);
  const int rank = mpi.world_rank(), p = mpi.world_size();
  int m = 3 * p, rounds = 5, steps = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--micro" && i + 1 < argc) m = std::stoi(argv[++i]);
    else if (a == "--rounds" && i + 1 < argc) rounds = std::max(1, std::stoi(argv[++i]));
    else if (a == "--steps" && i + 1 < argc) steps = std::max(2, std::stoi(argv[++i]));
    else {
      if (rank == 0) std::fprintf(stderr, "usage: zero_bubble_bench [--micro M] [--rounds N] [--steps S]\n");
      return 2;
    }
  }
  try {
    namespace fs = std::filesystem;
    const std::string dir = (fs::temp_directory_path() / "xirang_zero_bubble_bench").string();
    if (rank == 0) {
      fs::remove_all(dir);
      bench::write_random_tokens(dir + "/train", "bytes", 256, 1 << 18, 5);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const std::vector<std::string> kinds = {"1f1b", "zb_h1"};
    // Stage times, every rank at once (as in training).
    const StageTimes st = time_stage(bench_config(dir + "/train", p, m, steps, "zb_h1"), p, rank, rounds);
    std::vector<double> all(size_t(3 * p));
    const double mine[3] = {st.f, st.b, st.w};
    MPI_Allgather(mine, 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, MPI_COMM_WORLD);
    // Trainings in alternation.
    std::vector<std::vector<RunTimes>> runs(kinds.size());
    for (int r = 0; r < rounds; ++r)
      for (size_t k = 0; k < kinds.size(); ++k) {
        const size_t i = (k + size_t(r)) % kinds.size();
        runs[i].push_back(train(bench_config(dir + "/train", p, m, steps, kinds[i]), p));
      }
    // Rank means of each run's numbers, then medians over runs.
    std::vector<double> step(kinds.size()), bubble(kinds.size());
    std::vector<std::vector<double>> fwd(kinds.size()), bwd(kinds.size());  // per rank, per microbatch
    std::vector<size_t> acts(kinds.size());
    for (size_t k = 0; k < kinds.size(); ++k) {
      std::vector<double> s, b, f, bw;
      for (const RunTimes& t : runs[k]) {
        double mine2[2] = {t.step_ms, t.bubble}, sum[2] = {0, 0};
        MPI_Allreduce(mine2, sum, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        s.push_back(sum[0] / p);
        b.push_back(sum[1] / p);
        f.push_back(t.forward_ms);
        bw.push_back(t.backward_ms);
      }
      step[k] = bench::median(s);
      bubble[k] = bench::median(b);
      const double mine3[2] = {bench::median(f), bench::median(bw)};
      std::vector<double> both(size_t(2 * p));
      MPI_Allgather(mine3, 2, MPI_DOUBLE, both.data(), 2, MPI_DOUBLE, MPI_COMM_WORLD);
      for (int r = 0; r < p; ++r) {
        fwd[k].push_back(both[size_t(2 * r)]);
        bwd[k].push_back(both[size_t(2 * r + 1)]);
      }
      unsigned long long a = runs[k].front().activations, most = 0;
      MPI_Allreduce(&a, &most, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
      acts[k] = size_t(most);
    }
    if (rank == 0) {
      // W's share of a backward, from the stages timed alone; the forward
      // and whole-backward times from each schedule's own runs.
      double share = 0;
      for (int r = 0; r < p; ++r) {
        const double f = all[size_t(3 * r)], b = all[size_t(3 * r + 1)], w = all[size_t(3 * r + 2)];
        share += w / (b + w) / p;
        std::printf("stage %d alone, per microbatch: F %.2f ms, B %.2f ms, W %.2f ms\n", r, f, b, w);
      }
      auto costs_of = [&](size_t k) {
        SimCosts c;
        c.forward_per_rank = fwd[k];
        c.backward_per_rank = bwd[k];
        c.weight_share = share;
        return c;
      };
      const ScheduleKind kind_of[2] = {ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1};
      std::printf("pp=%d, m=%d, %d alternating rounds of %d steps; W is %.1f%% of a backward\n", p, m, rounds, steps,
                  100 * share);
      std::printf("| schedule | step ms (measured) | bubble (measured) | bubble (simulated from its run's F, B+W) | "
                  "F, B+W ms per microbatch (rank 0) | activations (plan) |\n|---|---|---|---|---|---|\n");
      for (size_t k = 0; k < kinds.size(); ++k) {
        const SimResult sim = simulate(kind_of[k], p, m, 1, costs_of(k));
        std::printf("| %s | %.2f | %.3f | %.3f | %.2f, %.2f | %.2f MiB |\n", kinds[k].c_str(), step[k], bubble[k],
                    sim.bubble_fraction, fwd[k][0], bwd[k][0], double(acts[k]) / (1 << 20));
      }
      // The gain the simulator predicts for the same stage times (1F1B's run).
      const SimResult s1 = simulate(ScheduleKind::OneFOneB, p, m, 1, costs_of(0));
      const SimResult sz = simulate(ScheduleKind::ZeroBubbleH1, p, m, 1, costs_of(0));
      const double predicted = 1 - sz.makespan / s1.makespan, measured = 1 - step[1] / step[0];
      std::printf("zb_h1 over 1f1b: step %.3fx (measured gain %.1f%%, predicted %.1f%%: %.0f%% of it); "
                  "activations %.3fx\n",
                  step[1] / step[0], 100 * measured, 100 * predicted, 100 * measured / predicted,
                  double(acts[1]) / double(acts[0]));
    }
    // The synchronisation's cost against the smallest bubble measured
    // (ms per step): the paper's post-validation removes that cost, and is
    // worth building only where it is a tenth of the bubble or more.
    const double sync_us = sync_latency_us(bench_config(dir + "/train", p, m, steps, "1f1b"), p, 200);
    if (rank == 0) {
      double least = 1e300;
      for (size_t k = 0; k < kinds.size(); ++k) least = std::min(least, bubble[k] * step[k]);
      std::printf("global synchronisation (pp barrier, norm sum, guard vote): %.1f us per step = %.2f%% of the "
                  "smallest bubble (%.2f ms per step)\n",
                  sync_us, 100 * sync_us / (1e3 * least), least);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) std::filesystem::remove_all(dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "zero_bubble_bench: rank %d: %s: %s\n", rank, error_kind_name(e.kind()), e.what());
    MpiRuntime::abort_world(1);
  }
  return 0;
}
