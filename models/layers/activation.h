// models/layers/activation.h: how layers declare their activations, beside
// ParamList's parameters.
//
// A layer lists each tensor its forward keeps for its backward, with its
// shape, its width (model dtype, or the wide dtype of statistics) and what
// activation recomputation (train.recompute) does with it. A chunk lays
// every list out twice: the entries a mode keeps once per activation slot,
// the entries it drops once, in a work set shared by every slot and layer,
// which the layer's recompute step refills just before its backward. The
// memory plan and the recompute step then follow from the same list.
//
//   ActList list;
//   norm.activations(list, acts.norm1, R, "norm 1");
//   attn.activations(list, acts.attn, B, T);
//   for (const ActSpec& a : list)
//     if (kept(a.keep, Recompute::Selective)) *a.tensor = arena.alloc(a.shape, a.wide ? wide : dtype, a.what);
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace xirang {

// Activation recomputation (train.recompute): what a chunk keeps per
// activation slot between a microbatch's forward and its backward, and what
// its backward recomputes first. Recomputation re-runs the same kernels on
// the same inputs, so losses and gradients are bitwise those of None.
//   None: every block's activations, per slot.
//   Selective: the entries tagged Keep::UnlessSelective are recomputed from
//     the kept ones (the attention core from qkv; the feed-forward's
//     activation from its kept input), into one shared set of buffers.
//   Full: only each block's output (the next block's input) is kept; the
//     block's forward is re-run, into one shared set of block activations,
//     just before its backward.
enum class Recompute { None, Selective, Full };
// "none", "selective", "full": the train.recompute spellings.
inline const char* recompute_name(Recompute r) {
  return r == Recompute::Full ? "full" : r == Recompute::Selective ? "selective" : "none";
}

// What recomputation keeps of one activation.
enum class Keep {
  Always,           // every mode keeps it (a block's output: the next block's input)
  UnlessFull,       // full recomputation rebuilds it by re-running the block's forward
  UnlessSelective,  // selective recomputation rebuilds it too (cheap to recompute, large to keep)
};
inline bool kept(Keep keep, Recompute mode) {
  switch (mode) {
    case Recompute::None: return true;
    case Recompute::Selective: return keep != Keep::UnlessSelective;
    case Recompute::Full: break;
  }
  return keep == Keep::Always;
}

struct ActSpec {
  Tensor* tensor;    // where the layer's forward and backward find it
  Shape shape;
  bool wide;         // statistics (mean, rstd, log-sum-exp): the chunk's grad_dtype()
  std::string what;  // the memory plan's label
  Keep keep;
  // A dtype of its own (the MoE router's F32 scores, I32 indices), else
  // the model's or the wide one per `wide`.
  std::optional<DType> dtype = std::nullopt;
};
using ActList = std::vector<ActSpec>;

}  // namespace xirang
