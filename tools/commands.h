// tools/commands.h: the `xirang` subcommands. Each returns the process exit
// code; library errors propagate as xirang::Error and main() prints them as
// one line.
#pragma once

namespace xirang::tools {

// xirang train CONFIG [--set section.key=value ...]
int train_command(int argc, char** argv);
// xirang data prepare|... (see tools/data_cmd.cc)
int data_command(int argc, char** argv);
// xirang ckpt inspect PATH | convert SRC DST ... (see tools/ckpt_cmd.cc)
int ckpt_command(int argc, char** argv);
// xirang eval CONFIG --checkpoint PATH [--set section.key=value ...]
int eval_command(int argc, char** argv);

// Whether a launcher (mpirun, srun) started this process: MPI is initialised only then.
bool launched_by_mpi();

}  // namespace xirang::tools
