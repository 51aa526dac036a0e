// The cost of one timeline site (core/timeline.h): a SpanScope or an
// OpScope with no timeline, with a timeline that records nothing, and with
// one that records, in nanoseconds per site against an empty loop measured
// in the same run. A training step of gpt2_debug passes about 1,300 op
// sites and a few hundred span sites; train_bench --overhead trace|op_profile
// measures the whole step.
//
//   build/bin/timeline_bench [--calls N]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench/bench_util.h"
#include "core/clock.h"
#include "core/timeline.h"

using namespace xirang;

namespace {

volatile int sink = 0;

}  // namespace

int main(int argc, char** argv) {
  long calls = 2000000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--calls" && i + 1 < argc) calls = std::atol(argv[++i]);
    else {
      std::fprintf(stderr, "usage: timeline_bench [--calls N]\n");
      return 2;
    }
  }
  Timeline idle, tracing, profiling;
  tracing.set_tracing(true);
  profiling.set_profiling(true);
  Timeline* none = nullptr;
  const double empty = bench::ns_per_call(calls, [](long i) { sink = int(i); });
  const auto span = [&](Timeline* tl) {
    return bench::ns_per_call(calls, [&](long i) {
      SpanScope s(tl, "forward", Track::Main, int(i & 7), 0);
      sink = int(i);
      if ((i & 0xffff) == 0 && tl) tl->take_spans();  // bounded memory
    });
  };
  const auto op = [&](Timeline* tl) {
    return bench::ns_per_call(calls, [&](long i) {
      OpScope s(tl, nullptr, OpKind::Matmul);
      sink = int(i);
    });
  };
  std::printf("timeline site cost, ns per call (empty loop %.2f ns, subtracted)\n", empty);
  std::printf("| site | no timeline | timeline off | recording |\n|---|---|---|---|\n");
  std::printf("| SpanScope | %.2f | %.2f | %.1f |\n", span(none) - empty, span(&idle) - empty, span(&tracing) - empty);
  std::printf("| OpScope | %.2f | %.2f | %.1f |\n", op(none) - empty, op(&idle) - empty, op(&profiling) - empty);
  return 0;
}
