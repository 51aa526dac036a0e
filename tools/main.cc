// The `xirang` command line: one binary, one subcommand per verb.
//
//   xirang train CONFIG [--set section.key=value ...]
//   xirang eval CONFIG --checkpoint PATH [--set section.key=value ...]
//   xirang generate CONFIG --checkpoint PATH --prompt TEXT [--max-new-tokens N] [--temperature T] [...]
//   xirang data prepare --tokenizer bytes --out DIR FILE...
//   xirang ckpt inspect PATH | convert SRC DST [...]
//   xirang report RUN [--baseline RUN2] [--plot DIR] [--json] [...]
//   xirang trace merge DIR [-o OUT.json]
//   xirang sweep SPEC.yaml [--out DIR] [--resume] [--dry-run]
//   xirang diagnose DIR
//
// Only this layer exits: library errors arrive as xirang::Error and leave as
// one line on stderr ("xirang: config error: ...") and exit code 1; usage
// errors exit with 2.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "core/error.h"
#include "core/omp_wait.h"
#include "tools/commands.h"

namespace {

const char* kUsage =
    "usage: xirang <command> [args]\n"
    "commands:\n"
    "  train CONFIG [--set section.key=value ...]   train a model (under mpirun for several ranks)\n"
    "  eval CONFIG --checkpoint PATH [--set ...]    print a checkpoint's loss on data.val (val_loss, 17 digits)\n"
    "  generate CONFIG --checkpoint PATH --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]\n"
    "           [--seed S] [--set ...]            continue a prompt with a checkpoint's model (one rank, CPU or\n"
    "                                                CUDA), printing the text as it comes; temperature 0 is greedy\n"
    "  data prepare --tokenizer gpt2|bytes --out DIR [--val-fraction F] [--force] [--threads N] INPUT...\n"
    "  data encode|decode --tokenizer gpt2|bytes    text on stdin -> ids on stdout, or back\n"
    "  data inspect DIR                              describe and verify a dataset split\n"
    "  ckpt inspect PATH                             list a checkpoint's tensors and verify their checksums\n"
    "  ckpt convert SRC DST [--layout dp=2,tp=2,pp=2,zero=1] [--dtype f32|bf16] [--params-only] [--to hf]\n"
    "               [--config CFG.yaml] [--force]    reshard a checkpoint, export/import Hugging Face safetensors,\n"
    "                                                import an llm.c model file\n"
    "  report RUN [--baseline RUN2] [--plot DIR] [--json] [--config CFG.yaml [--set ...]] [--tolerance F]\n"
    "             [--fail-on-regression] [--trace PATH]\n"
    "                                                summarise a run's metrics.jsonl: throughput, step-time split,\n"
    "                                                bottleneck and advice, deltas against a baseline (exit 3 on a\n"
    "                                                regression with --fail-on-regression), plots, per-rank\n"
    "                                                utilisation from a trace ([--trace PATH], or RUN/trace/)\n"
    "  trace merge DIR [-o OUT.json]                 merge metrics.trace's rank files into one Chrome trace\n"
    "                                                (default DIR/trace.json) on one time axis\n"
    "  plan CONFIG --cluster C.yaml (--gpus N | --layout tp=2,pp=4,...) [--top K] [--explain] [--json]\n"
    "       [--calibrate RESULTS.jsonl -o C.yaml]   predict memory and step time, rank layouts, fit a cluster\n"
    "  sweep SPEC.yaml [--out DIR] [--resume] [--dry-run]  run a benchmark sweep: results.jsonl/.csv, tables, plots\n"
    "  diagnose DIR                                  after a communication timeout: read the ranks'\n"
    "                                                comm_trace.rank<N>.json and name the rank the others wait for\n";

}  // namespace

int main(int argc, char** argv) {
  xirang::restart_with_passive_omp_wait(argv);
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  try {
    if (cmd == "train") return xirang::tools::train_command(argc - 1, argv + 1);
    if (cmd == "data") return xirang::tools::data_command(argc - 1, argv + 1);
    if (cmd == "ckpt") return xirang::tools::ckpt_command(argc - 1, argv + 1);
    if (cmd == "eval") return xirang::tools::eval_command(argc - 1, argv + 1);
    if (cmd == "generate") return xirang::tools::generate_command(argc - 1, argv + 1);
    if (cmd == "report") return xirang::tools::report_command(argc - 1, argv + 1);
    if (cmd == "trace") return xirang::tools::trace_command(argc - 1, argv + 1);
    if (cmd == "plan") return xirang::tools::plan_command(argc - 1, argv + 1);
    if (cmd == "sweep") return xirang::tools::sweep_command(argc - 1, argv + 1);
    if (cmd == "diagnose") return xirang::tools::diagnose_command(argc - 1, argv + 1);
    std::fprintf(stderr,
                 "xirang: usage error: unknown command '%s' (expected train, eval, generate, data, ckpt, report, trace, plan, sweep or diagnose)\n",
                 cmd.c_str());
    return 2;
  } catch (const xirang::Error& e) {
    std::fprintf(stderr, "xirang: %s: %s\n", xirang::error_kind_name(e.kind()), e.what());
    return e.kind() == xirang::ErrorKind::Usage ? 2 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "xirang: internal error: %s\n", e.what());
    return 1;
  }
}
