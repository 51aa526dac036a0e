// runtime/config/schedule_rules.h: what each pipeline schedule needs of the
// layout, stated once.
//
// Config validation, make_schedule (and so the executor, the simulator and
// the memory plan, which build their lists with it) and the planner's
// layout_problem all ask schedule_problem(), so a rule cannot hold in one
// and not in another:
//
//   schedule_problem(ScheduleKind::ZeroBubbleH1, /*pp=*/1, /*virtual_stages=*/1, /*microbatches=*/8)
//   // "parallel.schedule=zb_h1 needs parallel.pp >= 2 (one stage has no bubble ...)"
#pragma once

#include <string>
#include <string_view>

#include "models/placement.h"
#include "runtime/config/named_values.h"

namespace xirang {

// "" when `kind` can run `microbatches` per step over `pp` ranks with
// `virtual_stages` chunks each, else the rule it breaks, in config keys:
// only interleaved has virtual stages (two or more), and its microbatches
// are a multiple of pp; zb_h1, zb_h2 and zb_v need two stages or more, zb_v
// two virtual stages. `microbatches_from`,
// when given, says where the count came from in the message
// ("train.global_batch 8 / (train.micro_batch 1 x parallel.dp 1) = 8").
std::string schedule_problem(ScheduleKind kind, int pp, int virtual_stages, int microbatches,
                             std::string_view microbatches_from = "");

// "" when the pipeline executor (runtime/step/pipeline.h) can run `kind`
// over this transport, else why not: zb_v's V sends activations both ways
// between neighbours, which order-matched queues (comm.ordered_p2p, and
// NCCL on device.backend=cuda) cannot pair without a proof of their order
// (the tagged MPI channels pair any order), and zb_v with context
// parallelism has not run. Config validation asks; make_schedule and
// simulate do not.
std::string executor_problem(ScheduleKind kind, bool ordered_p2p, Backend backend, int cp);

// Where `kind` places the pp x virtual_stages model chunks: in a V under
// zb_v, round-robin otherwise (models/placement.h).
inline ChunkMap chunk_map(ScheduleKind kind, int pp, int virtual_stages) {
  return ChunkMap{pp, virtual_stages, kind == ScheduleKind::ZeroBubbleV ? ChunkOrder::V : ChunkOrder::RoundRobin};
}

}  // namespace xirang
