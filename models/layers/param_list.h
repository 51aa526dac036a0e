// models/layers/param_list.h: how layers declare their parameters.
//
// A layer declares each parameter once, with its name, global shape, shard
// and init rule, into a ParamList built for one tensor-parallel rank. The
// same declarations give the storage-free list that checkpoint conversion
// and memory plans read (ModelArch::parameters) and the list a chunk trains
// (ModelChunk::parameters): the layer keeps a ParamRef, which resolves into
// the chunk's final list once it no longer grows.
//
//   ParamList list(/*tp=*/2, /*tp_rank=*/1, DType::BF16, DType::F32);
//   ParamRef w = list.add("h.0.mlp.c_fc.weight", list.split({4 * C, C}, 0), true, 0, InitRule::normal(0.02));
//   std::vector<Parameter> params = list.take();
//   Parameter& p = w.in(params);
#pragma once

#include <string>
#include <vector>

#include "models/parameter.h"

namespace xirang {

// A parameter's place in its chunk's list.
class ParamRef {
 public:
  ParamRef() = default;
  explicit ParamRef(int index) : index_(index) {}
  bool declared() const { return index_ >= 0; }
  Parameter& in(std::vector<Parameter>& list) const { return list.at(size_t(index_)); }

 private:
  int index_ = -1;
};

class ParamList {
 public:
  ParamList(int tp, int tp_rank, DType dtype, DType grad_dtype)
      : tp_(tp), rank_(tp_rank), dtype_(dtype), grad_dtype_(grad_dtype) {}
  int tp() const { return tp_; }
  int tp_rank() const { return rank_; }

  // A parameter with no storage yet: value and grad are null views of the local shape.
  ParamRef add(const std::string& name, ShardSpec shard, bool decay, int layer, InitRule init);
  // Shards of this rank: whole, split along `dim` (in `blocks` equal blocks,
  // or blocks of the given global extents).
  ShardSpec whole(const Shape& g) const { return ShardSpec::whole(g); }
  ShardSpec split(const Shape& g, int dim, int blocks = 1) const { return ShardSpec::split(g, dim, tp_, rank_, blocks); }
  ShardSpec split_blocks(const Shape& g, int dim, std::vector<int64_t> sizes) const {
    return ShardSpec::split_blocks(g, dim, tp_, rank_, std::move(sizes));
  }
  Parameter& last() { return params_.back(); }
  std::vector<Parameter> take() { return std::move(params_); }

 private:
  int tp_, rank_;
  DType dtype_, grad_dtype_;
  std::vector<Parameter> params_;
};

}  // namespace xirang
