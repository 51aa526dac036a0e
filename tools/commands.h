// tools/commands.h: the `xirang` subcommands. Each returns the process exit
// code; library errors propagate as xirang::Error and main() prints them as
// one line.
#pragma once

#include "core/error.h"

namespace xirang::analysis::plan {}
namespace xirang::analysis::sweep {}
namespace xirang::analysis::report {}

namespace xirang::tools {

// The analyses the commands run (analysis/), under their short names.
namespace plan = ::xirang::analysis::plan;
namespace sweep = ::xirang::analysis::sweep;
namespace report = ::xirang::analysis::report;

// xirang train CONFIG [--set section.key=value ...]
int train_command(int argc, char** argv);
// xirang data prepare|... (see tools/data_cmd.cc)
int data_command(int argc, char** argv);
// xirang ckpt inspect PATH | convert SRC DST ... (see tools/ckpt_cmd.cc)
int ckpt_command(int argc, char** argv);
// xirang eval CONFIG --checkpoint PATH [--set section.key=value ...]
int eval_command(int argc, char** argv);
// xirang generate CONFIG --checkpoint PATH --prompt TEXT [...] (see tools/generate_cmd.cc)
int generate_command(int argc, char** argv);
// xirang report RUN [--baseline RUN2] [--plot DIR] [--json] ... (see tools/report_cmd.cc)
int report_command(int argc, char** argv);
// xirang sweep SPEC.yaml [--out DIR] [--resume] [--dry-run] (see tools/sweep_cmd.cc)
int sweep_command(int argc, char** argv);
// xirang trace merge DIR [-o OUT.json] (see tools/trace_cmd.cc)
int trace_command(int argc, char** argv);
// xirang plan CONFIG --cluster C.yaml ... (see tools/plan_cmd.cc)
int plan_command(int argc, char** argv);
// xirang diagnose DIR: which rank a timed-out job waited for (see tools/diagnose_cmd.cc)
int diagnose_command(int argc, char** argv);

// Whether a launcher (mpirun, srun) started this process: MPI is initialised only then.
// Throws ErrorKind::Usage for an srun step of several tasks that has no MPI
// process-management interface (srun --mpi=none): its tasks cannot form one job.
bool launched_by_mpi();
// A rank of a multi-rank job failed: peers may be blocked in a collective
// with it, so the whole job ends. Config and data errors are the same on
// every rank; rank 0 alone reports them, and the others give it a moment to
// do so before aborting.
[[noreturn]] void abort_job(const Error& e, int rank);

}  // namespace xirang::tools
