// runtime/step/schedule_zbv.h: ZB-V's placement and compute order, for
// runtime/step/schedule.cc (make_schedule and the simulator reach them
// through ScheduleKind::ZeroBubbleV).
//
// Rank r holds model chunks r and 2p - 1 - r (local chunks 0 and 1): the
// forward runs down the ranks and back up, so rank 0 holds the first
// chunk and the last (the embedding and the head), and rank p - 1 hands
// its first chunk's output to its second without a transfer.
//
//   zbv_compute_order(4, 1, 8, PassTimes{})  // Forward, BackwardInput and BackwardWeight only
#pragma once

#include <vector>

#include "runtime/step/schedule.h"

namespace xirang {

// Rank `rank`'s passes for one step of m microbatches, list-scheduled at
// `times` (one chunk's F, B and W): each (microbatch, local chunk)'s
// Forward, BackwardInput and BackwardWeight once, each kind in microbatch
// order per chunk. Throws unless the times are positive.
std::vector<PipeInstr> zbv_compute_order(int p, int rank, int m, const PassTimes& times);

}  // namespace xirang
