#include "models/layers/param_list.h"

namespace xirang {

ParamRef ParamList::add(const std::string& name, ShardSpec shard, bool decay, int layer, InitRule init) {
  const Shape local = shard.local_shape();
  params_.push_back({name, Tensor(nullptr, local, dtype_), Tensor(nullptr, local, grad_dtype_), decay, layer,
                     std::move(shard), false, false, init});
  return ParamRef(int(params_.size()) - 1);
}

}  // namespace xirang
