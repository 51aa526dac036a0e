// tools/commands.h: the `xirang` subcommands. Each returns the process exit
// code; library errors propagate as xirang::Error and main() prints them as
// one line.
#pragma once

namespace xirang::tools {

// xirang train CONFIG [--set section.key=value ...]
int train_command(int argc, char** argv);
// xirang data prepare|... (see tools/data_cmd.cc)
int data_command(int argc, char** argv);
// xirang ckpt inspect PATH (see tools/ckpt_cmd.cc)
int ckpt_command(int argc, char** argv);

}  // namespace xirang::tools
