// models/parameter.h: what a model parameter is, to the runtime.
//
// A Parameter is this rank's part of one named tensor of the single-rank
// model: its value and gradient (views into the runtime's arenas), where
// that part sits in the whole tensor (ShardSpec), and how its initial value
// is drawn (InitRule). The runtime reduces, clips, updates, saves and loads
// parameters through these fields alone; it never looks at a name to decide
// what to do.
//
//   Parameter p{"h.0.mlp.c_fc.weight", Tensor(nullptr, {4 * C / P, C}, dt), Tensor(nullptr, {4 * C / P, C}, gdt),
//               /*decay=*/true, /*layer=*/0, ShardSpec::split({4 * C, C}, 0, P, rank), /*tied=*/false,
//               /*tied_copy=*/false, InitRule::normal(0.02)};
//   init_parameter(p, seed);   // p.value = f(seed, name, global element index)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace xirang {

// How a parameter's local tensor maps onto the single-rank tensor: `dim` is
// split over `parts` ranks (-1: replicated), this rank holding part `index`.
// The split dimension is made of blocks, each split the same way: `blocks`
// equal blocks (3 for GPT-2's fused QKV: q, k and v rows, each split by
// heads), or, when `block_sizes` is not empty, blocks of those global
// extents (grouped-query attention's q, k and v differ). Every block's
// extent must divide by `parts`.
struct ShardSpec {
  Shape global;
  int dim = -1;
  int parts = 1;
  int index = 0;
  int blocks = 1;
  std::vector<int64_t> block_sizes;  // global extent of each block along dim; empty: `blocks` equal ones

  static ShardSpec whole(const Shape& g) { return ShardSpec{g, -1, 1, 0, 1, {}}; }
  static ShardSpec split(const Shape& g, int dim, int parts, int index, int blocks = 1) {
    return ShardSpec{g, dim, parts, index, blocks, {}};
  }
  // Blocks of unequal global extents (their sum is g[dim]).
  static ShardSpec split_blocks(const Shape& g, int dim, int parts, int index, std::vector<int64_t> sizes);

  bool replicated() const { return dim < 0 || parts == 1; }
  // The shape of the local tensor this rank holds (the split dimension divided by parts).
  Shape local_shape() const {
    Shape local = global;
    if (!replicated()) local[dim] /= parts;
    return local;
  }
  int block_count() const { return block_sizes.empty() ? blocks : int(block_sizes.size()); }
  // Global extent of block k along dim.
  int64_t block_extent(int k) const {
    return block_sizes.empty() ? global[dim] / blocks : block_sizes[size_t(k)];
  }
  bool equal_blocks() const;
  // Global flat index of local flat element i of a tensor of shape `local` (rank 1 or 2).
  int64_t global_index(const Shape& local, int64_t i) const;
};

// The initial value of a parameter, element by element, as a pure function
// of (seed, parameter name, global element index): a tensor- or
// pipeline-parallel shard is then exactly the slice of the single-rank model.
struct InitRule {
  enum class Kind { Normal, Zeros, Ones };
  Kind kind = Kind::Normal;
  double std = 0.02;
  int64_t drawn = -1;  // global flat elements [0, drawn) are drawn, the rest zero (padding rows); -1: all

  static InitRule normal(double std, int64_t drawn = -1) { return {Kind::Normal, std, drawn}; }
  static InitRule zeros() { return {Kind::Zeros, 0.0, -1}; }
  static InitRule ones() { return {Kind::Ones, 0.0, -1}; }
  // A projection into the residual stream: std scaled by 1/sqrt(2 n_layer)
  // (the GPT-2 paper, section 2.3), so that the stream's variance does not
  // grow with depth.
  static InitRule scaled_residual(double std, int n_layer);
  // The value of global element g of the parameter whose name hashes to `stream`.
  double value(uint64_t seed, uint64_t stream, int64_t g) const;
};

struct Parameter {
  std::string name;  // "h.3.mlp.c_fc.weight"
  Tensor value;      // this rank's part; shape comment at the definition site
  Tensor grad;       // same shape, accumulated over microbatches
  bool decay;        // weight decay applies (matrices and embeddings, not biases or norms)
  int layer;         // block index; -1 embeddings, n_layer for the final norm
  ShardSpec shard;   // where `value` sits in the single-rank tensor
  bool tied = false;        // one tensor with a parameter of another pipeline chunk (GPT-2's token table and head)
  bool tied_copy = false;   // the chunk's copy that is not the original (counted once in norms, saved once)
  InitRule init;            // how init_parameter() draws it
};

// Fills p.value (F32, F64, BF16 or F16, on any device) with p.init.
void init_parameter(const Parameter& p, uint64_t seed);

// Whether this backward pass makes the gradients final for the step: the
// last microbatch's does (gradient-ready hooks fire, sequence-parallel
// norm gradients are reduced across the tensor-parallel group).
enum class GradPhase { Accumulate, Final };

}  // namespace xirang
