// runtime/memory_estimate.h: the trainer's memory plan for any rank of any
// layout, without a process grid and without allocating.
//
// The trainer sizes its arenas by running the carving code against
// measuring arenas (Trainer::build_arenas). This runs the same code: the
// schedule of the rank's pipeline stage, the model's chunks built layout-only
// (TensorParallel without a group), ModelChunk::layout_parameters and
// layout_activations, AdamW::layout_state. Two pieces need a live object in
// the trainer and are mirrored here instead: the pipeline executor's token,
// target and gradient buffers (PipelineExecutor::layout) and the ZeRO
// gradient shard of GradSync's buckets. A test compares the result with
// Trainer::memory_plan() so the copies cannot drift.
//
//   Config cfg = load_config("configs/gpt2_debug.yaml", {"parallel.tp=2"});
//   validate(cfg, 2);
//   MemoryPlan plan = estimate_memory(cfg, {.pp_rank = 0, .tp_rank = 0});
//   plan.total();   // the bytes the trainer's plan prints for that rank
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "runtime/config/config.h"

namespace xirang {

struct RankCoords {
  int pp_rank = 0, tp_rank = 0, dp_rank = 0;
  int cp_rank = 0;  // every cp rank holds as many rows; it matters only to ZeRO's shard
};

// Categories and bytes as Trainer::plan_memory adds them (parameters,
// gradients, optimizer state, gradient shard with ZeRO, activations, input
// batch), for the rank at `at` of cfg's layout (cfg validated). The
// checkpoint snapshot in host memory is not included.
MemoryPlan estimate_memory(const Config& cfg, RankCoords at = {});

// The rank whose plan total is largest among the first and last pipeline
// stages (tp rank 0, dp rank 0): the one that must fit.
MemoryPlan estimate_peak_memory(const Config& cfg, int* pp_rank_out = nullptr);

// Activation bytes of one activation slot and the rest (scratch, buffers)
// of the rank at `at`, from two measurements with 1 and 2 slots.
struct ActivationSplit {
  size_t per_slot = 0, fixed = 0;
  int slots = 1;     // what the trainer would use
  int layers = 0;    // transformer layers on the rank, all chunks
};
ActivationSplit activation_split(const Config& cfg, RankCoords at = {});

}  // namespace xirang
