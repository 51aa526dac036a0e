// xirang train CONFIG [--set section.key=value ...]
//
// Under mpirun (or srun) every rank runs this; MPI is initialised only when
// a launcher started the process, so a plain `xirang train` needs no MPI.
// Errors before the process grid exists are the same on every rank (config,
// data): rank 0 reports them and all ranks exit normally. After that, a
// failing rank reports its error with its rank and aborts the whole job, so
// no peer is left waiting on a collective.
//
// Under Slurm, `srun --mpi=pmix` (or mpirun inside the allocation) starts the
// ranks. A multi-task srun step whose tasks got no process-management
// interface is refused before MPI starts, since every task would otherwise
// train alone as a world of one; rank 0 prints how the ranks lie on the nodes
// (and on several nodes, each node's first rank that node's line).
//
// SIGTERM or SIGUSR1 to any rank (or to mpirun, which forwards them) stops
// the run after the current step with a checkpoint and exit status 75
// (runtime/preemption.h); a second signal ends the process at once.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/error.h"
#include "runtime/comm_groups.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/faults.h"
#include "runtime/resilience/guards.h"
#include "runtime/trainer.h"
#include "tools/commands.h"

namespace xirang::tools {

void abort_job(const Error& e, int rank) {
  const bool shared = e.kind() == ErrorKind::Config || e.kind() == ErrorKind::Data ||
                      dynamic_cast<const AgreedError*>(&e) != nullptr;  // a failed checkpoint save
  if (!shared || rank == 0) std::fprintf(stderr, "xirang: rank %d: %s: %s\n", rank, error_kind_name(e.kind()), e.what());
  if (shared && rank != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
  // A timeout: the other ranks waiting on the same operation time out about
  // now too; the moment lets them write their comm traces before the abort.
  if (e.kind() == ErrorKind::Comm) std::this_thread::sleep_for(std::chrono::seconds(2));
  MpiRuntime::abort_world(1);
}

namespace {

// The task count of the srun step that started this process; 0 outside one.
// (The batch script of an sbatch job is no step: SLURM_NTASKS there is the
// allocation's, and mpirun or srun in the script start the ranks.)
int srun_step_tasks() {
  const char* v = std::getenv("SLURM_STEP_NUM_TASKS");
  return v ? std::atoi(v) : 0;
}

// This task's index in its Slurm step (SLURM_PROCID); 0 outside Slurm.
int slurm_task() {
  const char* v = std::getenv("SLURM_PROCID");
  return v ? std::atoi(v) : 0;
}

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(v)) return true;
  if (int n = srun_step_tasks(); n > 1)
    fail(ErrorKind::Usage, "srun started ", n, " tasks without an MPI process-management interface, so each "
         "would train alone as a world of one: launch with `srun --mpi=pmix` (`srun --mpi=list` shows what this "
         "Slurm offers; MpiDefault=pmix in slurm.conf makes it the default) or with mpirun inside the allocation");
  return false;
}

namespace {

// Who started the ranks, read before MPI_Init (which may add variables of its own).
struct Launch {
  bool mpirun = false;  // Open MPI's mpirun or MPICH's Hydra, also inside a Slurm allocation
  int srun_tasks = 0;   // the srun step's tasks when srun started the ranks itself
  std::string slurm_job;

  static Launch detect() {
    Launch l;
    l.mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("MPI_LOCALRANKID");
    if (!l.mpirun) l.srun_tasks = srun_step_tasks();
    if (const char* j = std::getenv("SLURM_JOB_ID")) l.slurm_job = j;
    return l;
  }
};

// srun's tasks must be one MPI world: fewer means the PMI plugin did not join them.
void check_world(const Launch& launch, int world) {
  if (launch.srun_tasks > 1 && world != launch.srun_tasks)
    fail(ErrorKind::Comm, "srun started ", launch.srun_tasks, " tasks but MPI joined them into a world of ", world,
         ": the step's MPI plugin does not match this MPI library; use `srun --mpi=pmix` with Open MPI "
         "(`srun --mpi=list` shows the plugins) or mpirun inside the allocation");
}

// "ranks 0,1": the world ranks of a node.
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += str_cat(s.empty() ? "" : ",", r);
  return s;
}

// "ranks: 4 on 2 nodes (2 per node), started by srun in Slurm job 17", and
// where a node runs more compute threads than it has CPUs, which and what
// that does to communication waits: what `grid`'s channels do there, as
// ProcessGrid::create_mpi decided it (comm.busy_poll=auto: sleep between
// polls), not what the config asked for. On several nodes, each node's
// first rank then prints that node's line (its ranks, threads, CPUs and
// polling: the decision is per node), and rank 0 one warning when
// tensor-parallel groups span nodes (their all-reduce, every layer, would
// cross the network: the grid puts tp on consecutive ranks, so it is the
// launcher's placement that split them).
void print_placement(const Launch& launch, const MpiRuntime& mpi, int compute_threads, ProcessGrid& grid) {
  const NodeLayout at = mpi.node_layout(compute_threads);  // collective: every rank computes it
  const double crowded_polling =  // ranks on crowded nodes whose channels busy-poll (collective too)
      grid.world().all_reduce_sum(at.crowded() && grid.busy_poll() == BusyPoll::On ? 1 : 0);
  bool tp_off_node = false;  // a peer of this rank's tp group runs on another node
  for (int r : tp_group_ranks(grid.shape(), grid.coords()))
    tp_off_node |= std::find(at.node_ranks.begin(), at.node_ranks.end(), r) == at.node_ranks.end();
  // Every member of a split group sees a peer elsewhere: the sum counts each such group tp times.
  const int split_tp_groups = int(grid.world().all_reduce_sum(tp_off_node ? 1 : 0)) / grid.shape().tp;
  if (mpi.world_rank() == 0) {
    const std::string per_node = at.min_per_node == at.max_per_node
                                     ? str_cat(at.max_per_node, " per node")
                                     : str_cat(at.min_per_node, " to ", at.max_per_node, " per node");
    const char* by = launch.mpirun ? "mpirun" : launch.srun_tasks > 0 ? "srun" : "an MPI launcher";
    const std::string job = launch.slurm_job.empty() ? "" : str_cat(" in Slurm job ", launch.slurm_job);
    std::string crowded;
    if (at.crowded_nodes > 0)
      crowded = str_cat("; more compute threads than CPUs on ", at.crowded_nodes, " node", at.crowded_nodes > 1 ? "s" : "",
                        " (", at.worst_ranks, " rank", at.worst_ranks > 1 ? "s" : "", ", ", at.worst_threads, " thread",
                        at.worst_threads > 1 ? "s" : "", ", ", at.worst_cpus, " CPU", at.worst_cpus > 1 ? "s" : "", ")",
                        crowded_polling == 0 ? ", so communication waits there sleep between polls" : "");
    std::printf("ranks: %d on %d node%s (%s), started by %s%s%s\n", mpi.world_size(), at.nodes, at.nodes > 1 ? "s" : "",
                per_node.c_str(), by, job.c_str(), crowded.c_str());
    const int tp_groups = mpi.world_size() / grid.shape().tp;
    if (split_tp_groups > 0)
      std::printf("warning: %d of %d tensor-parallel groups (tp=%d) span nodes, so their all-reduces (every layer) "
                  "cross the network: give each node a multiple of %d consecutive ranks (mpirun --map-by slot, "
                  "srun --distribution=block)\n",
                  split_tp_groups, tp_groups, grid.shape().tp, grid.shape().tp);
    std::fflush(stdout);
  }
  if (at.nodes > 1 && at.local_rank == 0) {
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    std::printf("node %s: ranks %s, %d compute thread%s on %d CPU%s, communication waits %s\n", host,
                rank_list(at.node_ranks).c_str(), at.node_threads, at.node_threads > 1 ? "s" : "", at.node_cpus,
                at.node_cpus > 1 ? "s" : "",
                grid.busy_poll() == BusyPoll::On ? "busy-poll" : "sleep between polls");
    std::fflush(stdout);
  }
}

// comm.trace_dir, else where the run's other files go (runtime/config/config.h).
std::string comm_trace_dir(const Config& cfg) {
  if (!cfg.comm.trace_dir.empty()) return cfg.comm.trace_dir;
  if (!cfg.metrics.jsonl.empty()) {
    const std::string parent = std::filesystem::path(cfg.metrics.jsonl).parent_path().string();
    return parent.empty() ? "." : parent;
  }
  return cfg.checkpoint.dir.empty() ? "." : cfg.checkpoint.dir;
}

struct TrainArgs {
  std::string config_path;
  std::vector<std::string> overrides;
};

TrainArgs parse_args(int argc, char** argv) {
  TrainArgs a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--set") {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "--set needs a value: --set section.key=value");
      a.overrides.push_back(argv[++i]);
    } else if (s.rfind("--set=", 0) == 0) {
      a.overrides.push_back(s.substr(6));
    } else if (!s.empty() && s[0] == '-') {
      fail(ErrorKind::Usage, "train: unknown option '", s, "' (expected --set section.key=value)");
    } else if (a.config_path.empty()) {
      a.config_path = s;
    } else {
      fail(ErrorKind::Usage, "train: more than one config file given ('", a.config_path, "' and '", s, "')");
    }
  }
  if (a.config_path.empty()) fail(ErrorKind::Usage, "train: no config file given (usage: xirang train CONFIG [--set k=v ...])");
  return a;
}

int train(const TrainArgs& args, MpiRuntime* mpi, const Launch& launch) {
  const int world = mpi ? mpi->world_size() : 1;
  const int rank = mpi ? mpi->world_rank() : 0;
  if (mpi) check_world(launch, world);
  Config cfg = load_config(args.config_path, args.overrides);
  validate(cfg, world);

  std::unique_ptr<ProcessGrid> grid;
  if (mpi) {
    LinkModel link{cfg.comm.latency_us, cfg.comm.bandwidth_gbps};
    // A transfer-failure fault is injected by the link decorator, so it must be present.
    if (cfg.faults.kind == FaultKind::FailTransfer && !link.active()) link.latency_us = 1e-3;
    grid = ProcessGrid::create_mpi(GridShape{cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp,
                                                  cfg.parallel.ep},
                                   comm_options(cfg, comm_trace_dir(cfg)), link);
    print_placement(launch, *mpi, omp_get_max_threads(), *grid);
  }
  try {
    // SIGTERM or SIGUSR1 from here on stops the run at a step boundary with a checkpoint (runtime/preemption.h).
    StopSignals signals;
    TrainerOptions opts;
    opts.stop = &signals;
    Trainer trainer(cfg, opts, grid.get());
    TrainResult r = trainer.run();
    if (r.preempted) return kPreemptedExitCode;  // the trainer printed the line
    if (rank == 0) {
      if (r.steps.empty())
        std::printf("nothing to train: the checkpoint is already at train.steps=%d\n", cfg.train.steps);
      else
        std::printf("trained to step %d of %d on %d rank%s: final train loss %.4f\n", r.steps.back().step,
                    cfg.train.steps, world, world > 1 ? "s" : "", r.losses.back());
      if (r.final_val_loss) {
        TokenDataset train = TokenDataset::open(cfg.data.train), val = TokenDataset::open(cfg.data.val);
        std::printf("validation loss %.4f nats/token; a unigram model of the training text scores %.4f\n",
                    *r.final_val_loss, unigram_cross_entropy(train, val));
      }
      if (!cfg.metrics.jsonl.empty()) std::printf("metrics: %s\n", cfg.metrics.jsonl.c_str());
    }
  } catch (const Error& e) {
    if (!mpi || world == 1) throw;
    abort_job(e, rank);
  }
  return 0;
}

}  // namespace

int train_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::printf("usage: xirang train CONFIG [--set section.key=value ...]\n"
                  "       mpirun -np N xirang train CONFIG [...]   (N = parallel.dp x cp x tp x pp)\n"
                  "SIGTERM or SIGUSR1 saves a checkpoint after the current step and exits with status %d;\n"
                  "a second signal exits at once.\n", xirang::kPreemptedExitCode);
      return 0;
    }
  // Before MPI, OpenMP or the loader start a thread (runtime/preemption.h).
  route_stop_signals();
  TrainArgs args = parse_args(argc, argv);
  const Launch launch = Launch::detect();
  bool multi_rank = false;
  try {
    multi_rank = launched_by_mpi();
  } catch (const Error&) {
    // The same refusal on every task of the srun step: the first task reports it.
    if (slurm_task() != 0) return 2;
    throw;
  }
  if (!multi_rank) return train(args, nullptr, launch);
  MpiRuntime mpi(&argc, &argv);
  try {
    return train(args, &mpi, launch);
  } catch (const Error& e) {
    // Raised before any rank could diverge (config, data): every rank sees the same error.
    // (srun's tasks that are each a world of one all have rank 0: the step's first reports.)
    if (mpi.world_rank() != 0 || (launch.srun_tasks > 0 && slurm_task() != 0)) return 1;
    throw;
  }
}

}  // namespace xirang::tools
