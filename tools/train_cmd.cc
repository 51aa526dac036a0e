// xirang train CONFIG [--set section.key=value ...]
//
// Under mpirun (or srun) every rank runs this; MPI is initialised only when
// a launcher started the process, so a plain `xirang train` needs no MPI.
// Errors before the process grid exists are the same on every rank (config,
// data): rank 0 reports them and all ranks exit normally. After that, a
// failing rank reports its error with its rank and aborts the whole job, so
// no peer is left waiting on a collective.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/error.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/trainer.h"
#include "tools/commands.h"

namespace xirang::tools {

void abort_job(const Error& e, int rank) {
  const bool shared = e.kind() == ErrorKind::Config || e.kind() == ErrorKind::Data;
  if (!shared || rank == 0) std::fprintf(stderr, "xirang: rank %d: %s: %s\n", rank, error_kind_name(e.kind()), e.what());
  if (shared && rank != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
  MpiRuntime::abort_world(1);
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(v)) return true;
  return false;
}

namespace {

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

int train(const TrainArgs& args, MpiRuntime* mpi) {
  const int world = mpi ? mpi->world_size() : 1;
  const int rank = mpi ? mpi->world_rank() : 0;
  Config cfg = load_config(args.config_path, args.overrides);
  validate(cfg, world);

  std::unique_ptr<ProcessGrid> grid;
  if (mpi) {
    LinkModel link{cfg.comm.latency_us, cfg.comm.bandwidth_gbps};
    // A transfer-failure fault is injected by the link decorator, so it must be present.
    if (cfg.faults.kind == FaultKind::FailTransfer && !link.active()) link.latency_us = 1e-3;
    grid = ProcessGrid::create_mpi(GridShape{cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp},
                                   CommOptions{cfg.comm.timeout_s}, link);
  }
  try {
    Trainer trainer(cfg, TrainerOptions{}, grid.get());
    TrainResult r = trainer.run();
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
                  "       mpirun -np N xirang train CONFIG [...]   (N = parallel.dp x tp x pp)\n");
      return 0;
    }
  TrainArgs args = parse_args(argc, argv);
  if (!launched_by_mpi()) return train(args, nullptr);
  MpiRuntime mpi(&argc, &argv);
  try {
    return train(args, &mpi);
  } catch (const Error& e) {
    // Raised before any rank could diverge (config, data): every rank sees the same error.
    if (mpi.world_rank() != 0) return 1;
    throw;
  }
}

}  // namespace xirang::tools
