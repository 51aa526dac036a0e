// The step's time accounting under MPI: the named parts of step_ms are
// disjoint and leave little unnamed.
//
//   mpirun -np 8 parallel_step_time_check --data DIR --set parallel.dp=2 --set parallel.tp=2 --set parallel.pp=2
//       [--steps 8] [--max-unaccounted 0.10] [--op-profile]
//
// Every rank trains the layout and checks its own StepMetrics for every
// step after the first (the first pays for warm-up): each part is >= 0,
// dp_comm_exposed_ms <= dp_comm_ms, and the parts plus unaccounted_ms equal
// step_ms to the microsecond (the step clock charges every instant once:
// core/step_clock.h). Over those steps the median of the unaccounted
// fraction, unaccounted_ms / step_ms, must stay under --max-unaccounted.
// Each rank prints its medians; exits non-zero on any failure on any rank.
//
// --op-profile trains with metrics.op_profile and also checks the per-op
// times (StepMetrics::ops) of every step after the first: every op_ms is
// >= 0; the compute kinds (the kernels' wall time on the CPU) fit inside
// the passes that run them, forward + backward + optimizer + data_wait
// (x 1.05 + 1 ms for clock noise; the few ops outside them, such as
// zeroing the gradients, are small); the layout's collectives are there
// (tp > 1: tp_all_reduce, or with sequence parallelism tp_all_gather and
// tp_reduce_scatter; dp > 1: dp_all_reduce, or with ZeRO-1
// dp_reduce_scatter and dp_all_gather; pp > 1: pp_send and pp_recv). Over
// the steps, the compute ops' median share of forward + backward +
// optimizer is at least half (the ops are most of the passes; a median,
// because a rank descheduled between two ops, 8 ranks on 2 cores, stretches
// one step's passes alone), and matmul has the largest median of the
// compute kinds (true of gpt2_debug on every stage).
#include <mpi.h>

#include <cmath>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "runtime/comm_groups.h"
#include "runtime/config/config.h"
#include "core/timeline.h"
#include "runtime/trainer.h"

using namespace xirang;

namespace {

struct Args {
  std::string data;
  std::vector<std::string> overrides;
  int steps = 8;
  double max_unaccounted = 0.10;  // median fraction of step_ms
  bool op_profile = false;        // also check the per-op times
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--data" && i + 1 < argc) a.data = argv[++i];
    else if (s == "--set" && i + 1 < argc) a.overrides.push_back(argv[++i]);
    else if (s == "--steps" && i + 1 < argc) a.steps = std::stoi(argv[++i]);
    else if (s == "--max-unaccounted" && i + 1 < argc) a.max_unaccounted = std::stod(argv[++i]);
    else if (s == "--op-profile") a.op_profile = true;
    else fail(ErrorKind::Usage, "parallel_step_time_check: unexpected argument '", s, "'");
  }
  if (a.data.empty()) fail(ErrorKind::Usage, "parallel_step_time_check: --data DIR is required");
  if (a.steps < 3) fail(ErrorKind::Usage, "parallel_step_time_check: --steps must be at least 3");
  return a;
}

// The named parts of step_ms, in the order of docs/metrics.md.
struct Part {
  const char* name;
  double StepMetrics::*field;
};
const Part kParts[] = {{"forward", &StepMetrics::forward_ms},
                       {"backward", &StepMetrics::backward_ms},
                       {"optimizer", &StepMetrics::optimizer_ms},
                       {"data_wait", &StepMetrics::data_wait_ms},
                       {"dp_exposed", &StepMetrics::dp_comm_exposed_ms},
                       {"tp_comm", &StepMetrics::tp_comm_ms},
                       {"cp_comm", &StepMetrics::cp_comm_ms},
                       {"pp_bubble", &StepMetrics::pp_bubble_ms},
                       {"pp_exposed", &StepMetrics::pp_comm_exposed_ms},
                       {"ckpt_stall", &StepMetrics::ckpt_stall_ms}};

double parts_ms(const StepMetrics& m) {
  double sum = 0;
  for (const Part& p : kParts) sum += m.*p.field;
  return sum;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The collectives a layout must show in op_calls.
std::vector<OpKind> expected_comm(const ParallelConfig& p) {
  std::vector<OpKind> kinds;
  if (p.tp > 1) {
    if (p.sequence_parallel) kinds.insert(kinds.end(), {OpKind::TpAllGather, OpKind::TpReduceScatter});
    else kinds.push_back(OpKind::TpAllReduce);
  }
  if (p.dp > 1) {
    if (p.zero == 1) kinds.insert(kinds.end(), {OpKind::DpReduceScatter, OpKind::DpAllGather});
    else kinds.push_back(OpKind::DpAllReduce);
  }
  if (p.pp > 1) kinds.insert(kinds.end(), {OpKind::PpSend, OpKind::PpRecv});
  return kinds;
}

// The compute kinds' share of forward + backward + optimizer.
double compute_share(const StepMetrics& m) {
  double compute = 0;
  for (int k = 0; k < kOpKindCount; ++k)
    if (!op_kind_is_comm(OpKind(k))) compute += m.ops->ms[size_t(k)];
  const double passes = m.forward_ms + m.backward_ms + m.optimizer_ms;
  return passes > 0 ? compute / passes : 1;
}

// The per-op checks of one step (--op-profile); appends failures to `fails`.
void check_ops(const StepMetrics& m, const std::vector<OpKind>& comm, std::string& fails) {
  char buf[200];
  if (!m.ops) {
    std::snprintf(buf, sizeof buf, " step %d: no op times;", m.step);
    fails += buf;
    return;
  }
  const OpTimes& ops = *m.ops;
  double compute = 0;
  for (int k = 0; k < kOpKindCount; ++k) {
    if (ops.ms[size_t(k)] < 0) {
      std::snprintf(buf, sizeof buf, " step %d: op_ms %s %.3f < 0;", m.step, op_kind_name(OpKind(k)), ops.ms[size_t(k)]);
      fails += buf;
    }
    if (!op_kind_is_comm(OpKind(k))) compute += ops.ms[size_t(k)];
  }
  const double passes = m.forward_ms + m.backward_ms + m.optimizer_ms;
  if (compute > (passes + m.data_wait_ms) * 1.05 + 1) {
    std::snprintf(buf, sizeof buf, " step %d: compute ops %.3f ms > (passes %.3f + data_wait %.3f) x 1.05 + 1;",
                  m.step, compute, passes, m.data_wait_ms);
    fails += buf;
  }
  for (OpKind k : comm)
    if (ops.calls[size_t(k)] <= 0) {
      std::snprintf(buf, sizeof buf, " step %d: no %s;", m.step, op_kind_name(k));
      fails += buf;
    }
}

}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const int rank = mpi.world_rank(), world = mpi.world_size();
  int bad = 0;
  try {
    const Args args = parse(argc, argv);
    std::vector<std::string> o = {"data.train=" + args.data + "/train", "train.steps=" + std::to_string(args.steps),
                                  "metrics.jsonl="};
    if (args.op_profile) o.push_back("metrics.op_profile=true");
    o.insert(o.end(), args.overrides.begin(), args.overrides.end());
    Config cfg = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/gpt2_debug.yaml", o);
    validate(cfg, world);
    auto grid = ProcessGrid::create_mpi(GridShape{cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp,
                                                  cfg.parallel.ep},
                                        comm_options(cfg),
                                        LinkModel{cfg.comm.latency_us, cfg.comm.bandwidth_gbps});
    TrainerOptions quiet;
    quiet.print = false;
    quiet.peak = PeakFlops{1e11, "test"};
    Trainer t(cfg, quiet, grid.get());
    const TrainResult r = t.run();

    std::string fails;
    std::vector<double> unaccounted, step_ms;
    std::vector<std::vector<double>> part_ms(std::size(kParts));
    const std::vector<OpKind> comm = expected_comm(cfg.parallel);
    std::vector<std::vector<double>> op_ms(kOpKindCount);
    std::vector<double> op_share;  // compute ops / (forward + backward + optimizer), per step
    for (size_t i = 1; i < r.steps.size(); ++i) {
      const StepMetrics& m = r.steps[i];
      char buf[160];
      for (const Part& p : kParts)
        if (m.*p.field < 0) {
          std::snprintf(buf, sizeof buf, " step %d: %s_ms %.3f < 0;", m.step, p.name, m.*p.field);
          fails += buf;
        }
      if (m.dp_comm_exposed_ms > m.dp_comm_ms) {
        std::snprintf(buf, sizeof buf, " step %d: dp_comm_exposed_ms %.3f > dp_comm_ms %.3f;", m.step,
                      m.dp_comm_exposed_ms, m.dp_comm_ms);
        fails += buf;
      }
      const double sum = parts_ms(m);
      if (std::abs(sum + m.unaccounted_ms - m.step_ms) > 1e-3) {
        std::snprintf(buf, sizeof buf, " step %d: parts %.6f ms + unaccounted %.6f ms != step_ms %.6f;", m.step, sum,
                      m.unaccounted_ms, m.step_ms);
        fails += buf;
      }
      if (m.unaccounted_ms < 0) {
        std::snprintf(buf, sizeof buf, " step %d: unaccounted_ms %.6f < 0;", m.step, m.unaccounted_ms);
        fails += buf;
      }
      unaccounted.push_back(m.unaccounted_ms / m.step_ms);
      step_ms.push_back(m.step_ms);
      for (size_t k = 0; k < std::size(kParts); ++k) part_ms[k].push_back(r.steps[i].*kParts[k].field);
      if (args.op_profile) {
        check_ops(m, comm, fails);
        if (m.ops) {
          for (int k = 0; k < kOpKindCount; ++k) op_ms[size_t(k)].push_back(m.ops->ms[size_t(k)]);
          op_share.push_back(compute_share(m));
        }
      }
    }
    const double u = median(unaccounted);
    if (u >= args.max_unaccounted) {
      char buf[120];
      std::snprintf(buf, sizeof buf, " median unaccounted %.1f%% >= %.1f%%;", 100 * u, 100 * args.max_unaccounted);
      fails += buf;
    }
    // One line per rank, in rank order.
    std::string line = "rank " + std::to_string(rank) + ": median step " + std::to_string(int(median(step_ms))) + " ms";
    for (size_t k = 0; k < std::size(kParts); ++k) {
      char buf[48];
      std::snprintf(buf, sizeof buf, ", %s %.1f", kParts[k].name, median(part_ms[k]));
      line += buf;
    }
    char tail[64];
    std::snprintf(tail, sizeof tail, "; unaccounted %.1f%%", 100 * u);
    line += tail;
    if (args.op_profile && !op_ms[0].empty()) {
      line += "; ops";
      int largest = 0;
      for (int k = 0; k < kOpKindCount; ++k) {
        const double med = median(op_ms[size_t(k)]);
        if (!op_kind_is_comm(OpKind(k)) && med > median(op_ms[size_t(largest)])) largest = k;
        if (med == 0) continue;
        char buf[48];
        std::snprintf(buf, sizeof buf, " %s %.1f", op_kind_name(OpKind(k)), med);
        line += buf;
      }
      char share[64];
      std::snprintf(share, sizeof share, "; compute ops %.0f%% of the passes", 100 * median(op_share));
      line += share;
      if (median(op_share) < 0.5) {
        char buf[96];
        std::snprintf(buf, sizeof buf, " median compute ops %.1f%% < 50%% of the passes;", 100 * median(op_share));
        fails += buf;
      }
      if (OpKind(largest) != OpKind::Matmul) {
        char buf[96];
        std::snprintf(buf, sizeof buf, " the largest compute kind is %s, not matmul;",
                      op_kind_name(OpKind(largest)));
        fails += buf;
      }
    }
    bad = fails.empty() ? 0 : 1;
    for (int rr = 0; rr < world; ++rr) {
      if (rr == rank) {
        std::printf("%s: %s%s\n", bad ? "FAIL" : "ok", line.c_str(), fails.c_str());
        std::fflush(stdout);
      }
      MPI_Barrier(MPI_COMM_WORLD);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    bad = 1;
  }
  int any_bad = 0;
  MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%s\n", any_bad ? "step time check FAILED" : "step time check passed");
  return any_bad ? 1 : 0;
}
