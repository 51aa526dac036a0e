#include "models/parameter.h"

#include <cmath>
#include <numeric>

#include "core/device_memory.h"
#include "core/error.h"
#include "core/rng.h"

namespace xirang {

ShardSpec ShardSpec::split_blocks(const Shape& g, int dim, int parts, int index, std::vector<int64_t> sizes) {
  XR_CHECK(dim >= 0 && dim < g.rank(), "split_blocks: dimension ", dim, " of ", g.str());
  XR_CHECK(std::accumulate(sizes.begin(), sizes.end(), int64_t(0)) == g[dim], "split_blocks: block sizes of ",
           g.str(), " along ", dim, " do not add up");
  ShardSpec s{g, dim, parts, index, int(sizes.size()), std::move(sizes)};
  // Equal blocks are described the plain way (and stored as before in checkpoints).
  if (s.equal_blocks()) s.block_sizes.clear();
  return s;
}

bool ShardSpec::equal_blocks() const {
  for (size_t k = 1; k < block_sizes.size(); ++k)
    if (block_sizes[k] != block_sizes[0]) return false;
  return true;
}

int64_t ShardSpec::global_index(const Shape& local, int64_t i) const {
  if (replicated()) return i;
  // x: the index along the split dimension of the local tensor.
  auto map = [&](int64_t x) {
    if (block_sizes.empty()) {
      const int64_t lb = local[dim] / blocks;  // local rows (or columns) per block
      return (x / lb) * lb * parts + index * lb + x % lb;
    }
    int64_t global_begin = 0;
    for (int64_t gb : block_sizes) {
      const int64_t lb = gb / parts;
      if (x < lb) return global_begin + index * lb + x;
      x -= lb;
      global_begin += gb;
    }
    fail(ErrorKind::Internal, "ShardSpec::global_index: local index past the last block");
  };
  if (local.rank() == 1) return map(i);
  const int64_t r = i / local[1], c = i % local[1];
  return dim == 0 ? map(r) * global[1] + c : r * global[1] + map(c);
}

InitRule InitRule::scaled_residual(double std, int n_layer) { return normal(std / std::sqrt(2.0 * n_layer)); }

double InitRule::value(uint64_t seed, uint64_t stream, int64_t g) const {
  switch (kind) {
    case Kind::Zeros: return 0.0;
    case Kind::Ones: return 1.0;
    case Kind::Normal: break;
  }
  return drawn < 0 || g < drawn ? std * rng_normal(seed, stream, uint64_t(g)) : 0.0;
}

void init_parameter(const Parameter& p, uint64_t seed) {
  const uint64_t stream = name_stream(p.name);
  const int64_t n = p.value.numel();
  const Shape local = p.value.shape();
  // Device parameters are filled on the host and copied over.
  std::vector<char> staging;
  Tensor dst = p.value;
  if (dst.device() != Device::CPU) {
    staging.resize(dst.bytes());
    dst = Tensor(staging.data(), local, p.value.dtype());
  }
  auto value_at = [&](int64_t i) { return p.init.value(seed, stream, p.shard.global_index(local, i)); };
  switch (dst.dtype()) {
    case DType::F32: {
      float* v = dst.data<float>();
      for (int64_t i = 0; i < n; ++i) v[i] = float(value_at(i));
      break;
    }
    case DType::F64: {
      double* v = dst.data<double>();
      for (int64_t i = 0; i < n; ++i) v[i] = value_at(i);
      break;
    }
    case DType::BF16: {
      bf16* v = dst.data<bf16>();
      for (int64_t i = 0; i < n; ++i) v[i] = float_to_bf16(float(value_at(i)));
      break;
    }
    case DType::F16: {
      f16* v = dst.data<f16>();
      for (int64_t i = 0; i < n; ++i) v[i] = float_to_f16(float(value_at(i)));
      break;
    }
    default: fail(ErrorKind::Internal, "init_parameter: unsupported dtype ", dtype_name(dst.dtype()), " of ", p.name);
  }
  if (dst.raw() != p.value.raw()) copy_tensor(p.value, dst);
}

}  // namespace xirang
