// xirang trace merge DIR [-o OUT.json]
//
// Merges metrics.trace's per-rank files (DIR/rank_NNNNN.json) into one
// Chrome trace-event file (default DIR/trace.json) on one time axis: each
// rank's timestamps less its clock at the barrier before the first traced
// step. The reading and checking live in analysis/report/trace.cc.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "tools/commands.h"
#include "analysis/report/trace.h"

namespace xirang::tools {

namespace {

const char* kTraceUsage =
    "usage: xirang trace merge DIR [-o OUT.json]\n"
    "  DIR        a metrics.trace directory: one rank_NNNNN.json per rank of the run\n"
    "  -o FILE    where to write the merged trace (default DIR/trace.json); open it in\n"
    "             https://ui.perfetto.dev or chrome://tracing\n";

struct MergeArgs {
  std::string dir, out;
};

MergeArgs parse_merge_args(int argc, char** argv) {
  MergeArgs a;
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "-o" || s == "--output") {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "trace merge: ", s, " needs a file name");
      a.out = argv[++i];
    } else if (!s.empty() && s[0] == '-') {
      fail(ErrorKind::Usage, "trace merge: unknown option '", s, "' (see xirang trace --help)");
    } else if (a.dir.empty()) {
      a.dir = s;
    } else {
      fail(ErrorKind::Usage, "trace merge: more than one directory given ('", a.dir, "' and '", s, "')");
    }
  }
  if (a.dir.empty())
    fail(ErrorKind::Usage, "trace merge: no directory given (usage: xirang trace merge DIR [-o OUT.json])");
  if (a.out.empty()) a.out = (std::filesystem::path(a.dir) / "trace.json").string();
  return a;
}

int merge(const MergeArgs& a) {
  const report::Trace t = report::load_rank_traces(a.dir);
  const nlohmann::ordered_json merged = report::merge_traces(t);
  report::write_json_atomic(a.out, merged);
  size_t spans = 0;
  double max_offset = 0;
  for (const report::RankTrace& r : t.ranks) {
    for (const auto& e : r.events) spans += e.value("ph", "") == "X";
    max_offset = std::max(max_offset, std::fabs(report::clock_offset_us(t, r.rank)));
  }
  std::printf("merged %d ranks, %zu spans, steps %d-%d, max clock offset %.3f ms -> %s\n", t.world_size, spans,
              t.first_step, t.last_step, max_offset / 1e3, a.out.c_str());
  return 0;
}

}  // namespace

int trace_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::fputs(kTraceUsage, stdout);
      return 0;
    }
  if (argc < 2) fail(ErrorKind::Usage, "trace: no subcommand given (usage: xirang trace merge DIR [-o OUT.json])");
  if (std::strcmp(argv[1], "merge") != 0)
    fail(ErrorKind::Usage, "trace: unknown subcommand '", argv[1], "' (expected merge)");
  return merge(parse_merge_args(argc, argv));
}

}  // namespace xirang::tools
