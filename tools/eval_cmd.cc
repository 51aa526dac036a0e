// xirang eval CONFIG --checkpoint PATH [--set section.key=value ...]
//
// Loads the checkpoint PATH (a step directory or a root: its newest step)
// into the model CONFIG describes, in the layout CONFIG and the launcher give
// (any layout loads any checkpoint), and prints its mean loss over
// train.eval_batches microbatches of data.val as `val_loss <17 significant
// digits>`, on rank 0. It neither trains nor writes checkpoints: the
// config's checkpoint.dir and train.steps are ignored. A parameters-only
// checkpoint (an import) evaluates like any other.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/error.h"
#include "runtime/comm_groups.h"
#include "runtime/checkpoint/checkpoint_convert.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/config.h"
#include "runtime/trainer.h"
#include "tools/commands.h"

namespace xirang::tools {

namespace {

struct EvalArgs {
  std::string config_path, checkpoint;
  std::vector<std::string> overrides;
};

EvalArgs parse_args(int argc, char** argv) {
  EvalArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "eval: ", s, " needs a value");
      return argv[++i];
    };
    if (s == "--set") a.overrides.push_back(value());
    else if (s.rfind("--set=", 0) == 0) a.overrides.push_back(s.substr(6));
    else if (s == "--checkpoint") a.checkpoint = value();
    else if (s.rfind("--checkpoint=", 0) == 0) a.checkpoint = s.substr(13);
    else if (!s.empty() && s[0] == '-')
      fail(ErrorKind::Usage, "eval: unknown option '", s, "' (expected --checkpoint, --set)");
    else if (a.config_path.empty()) a.config_path = s;
    else fail(ErrorKind::Usage, "eval: more than one config file given ('", a.config_path, "' and '", s, "')");
  }
  if (a.config_path.empty() || a.checkpoint.empty())
    fail(ErrorKind::Usage,
         "eval: expected a config and a checkpoint (usage: xirang eval CONFIG --checkpoint PATH [--set k=v ...])");
  return a;
}

int evaluate(const EvalArgs& args, MpiRuntime* mpi) {
  const int world = mpi ? mpi->world_size() : 1;
  const int rank = mpi ? mpi->world_rank() : 0;
  Config cfg = load_config(args.config_path, args.overrides);
  if (cfg.data.val.empty())
    fail(ErrorKind::Config, "eval needs a validation split: data.val is empty (--set data.val=DIR)");
  const std::string step_dir = checkpoint_step_dir(args.checkpoint);
  const int64_t step = read_checkpoint_meta(step_dir).step;
  // Load exactly this checkpoint, never save one, and accept its step whatever train.steps says.
  cfg.checkpoint.dir.clear();
  cfg.checkpoint.resume = ResumeMode::Path;
  cfg.checkpoint.resume_path = step_dir;
  cfg.train.steps = int(std::max<int64_t>({int64_t(cfg.train.steps), step, 1}));
  validate(cfg, world);

  std::unique_ptr<ProcessGrid> grid;
  if (mpi)
    grid = ProcessGrid::create_mpi(GridShape{cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp,
                                                  cfg.parallel.ep},
                                   comm_options(cfg), LinkModel{cfg.comm.latency_us, cfg.comm.bandwidth_gbps});
  try {
    TrainerOptions opts;
    opts.print = false;
    opts.peak = PeakFlops{1.0, "not measured (eval)"};  // no training, no MFU
    Trainer trainer(cfg, opts, grid.get());
    const double loss = trainer.evaluate();
    if (rank == 0) {
      std::fprintf(stderr, "evaluated %s (step %lld) on %s\n", step_dir.c_str(), (long long)step, cfg.data.val.c_str());
      std::printf("val_loss %.17g\n", loss);
    }
  } catch (const Error& e) {
    if (!mpi || world == 1) throw;
    abort_job(e, rank);
  }
  return 0;
}

}  // namespace

int eval_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::printf("usage: xirang eval CONFIG --checkpoint PATH [--set section.key=value ...]\n"
                  "       mpirun -np N xirang eval CONFIG --checkpoint PATH [...]   (N = parallel.dp x tp x pp)\n");
      return 0;
    }
  const EvalArgs args = parse_args(argc, argv);
  if (!launched_by_mpi()) return evaluate(args, nullptr);
  MpiRuntime mpi(&argc, &argv);
  try {
    return evaluate(args, &mpi);
  } catch (const Error& e) {
    // Raised before any rank could diverge (config, checkpoint path): every rank sees the same error.
    if (mpi.world_rank() != 0) return 1;
    throw;
  }
}

}  // namespace xirang::tools
