// runtime/config/model_layout.h: the layout and batch a configuration gives
// a model's chunks (the model itself is cfg.model, a ModelDims).
//
// The trainer builds its chunks from these, and so does the offline
// checkpoint converter when it lists what each rank of another layout
// holds: one translation of the config keeps the two from drifting apart.
//
//   check_layout(cfg.model, parallel_layout(cfg.parallel));    // models/model.h
//   arch.make_chunk(cfg.model, placement, dtype, chunk_batch(cfg, slots), tp);
#pragma once

#include "models/model.h"
#include "runtime/config/config.h"
#include "runtime/config/schedule_rules.h"

namespace xirang {

// A chunk's batch: the config's microbatch shape and recompute mode, with
// `slots` activation slots, split backward under a schedule that splits it
// with `input_slots` and `weight_slots` (runtime/step/schedule.h's
// slot_counts; 0: as many as activation slots). Its cp is the config's
// size and split as cp rank 0 without a group: what a memory plan lays out
// (every cp rank holds as many rows); the trainer sets its rank and group.
inline ChunkBatch chunk_batch(const Config& c, int slots, int input_slots = 0, int weight_slots = 0) {
  return ChunkBatch{.micro_batch = c.train.micro_batch,
                    .seq_len = c.seq_len(),
                    .activation_slots = slots,
                    .recompute = c.train.recompute,
                    .split_backward = splits_backward(c.parallel.schedule),
                    .input_slots = input_slots,
                    .weight_slots = weight_slots,
                    .cp = ContextParallel{.size = c.parallel.cp,
                                          .head_tail = c.parallel.cp_split == CpSplit::HeadTail,
                                          .exchange = c.parallel.cp_comm == CpCommKind::Ring ? CpExchange::Ring
                                                                                              : CpExchange::AllGather}};
}

// Where the config's schedule places the model chunks (runtime/config/schedule_rules.h).
inline ChunkMap chunk_map(const ParallelConfig& p) { return chunk_map(p.schedule, p.pp, p.virtual_stages); }

inline ParallelLayout parallel_layout(const ParallelConfig& p) {
  return ParallelLayout{p.dp, p.tp, p.pp, p.virtual_stages};
}

}  // namespace xirang
