// tests/models/model_fixture.h: a model chunk (GPT2, Llama) laid out in arenas of its own, with
// random parameters, for tests that compare models.
//
//   ModelInArenas m(dims, ChunkPlacement::whole(dims.n_layer), DType::F64, batch);  // GPT2's arguments
//   randomize_parameters(m.model, /*seed=*/17);
#pragma once

#include <cstring>
#include <string>
#include <utility>

#include "core/rng.h"
#include "models/gpt2/gpt2.h"

namespace xirang {

template <class Model>
struct ChunkInArenas {
  Model model;
  Arena params, grads, acts;
  // Builds the model in place (it holds pointers into itself), then carves its arenas.
  template <class... Args>
  explicit ChunkInArenas(Args&&... args) : model(std::forward<Args>(args)...) {
    Arena mp = Arena::measuring("p"), mg = Arena::measuring("g"), ma = Arena::measuring("a");
    model.layout_parameters(mp, mg);
    model.layout_activations(ma);
    params = Arena("p", mp.used());
    grads = Arena("g", mg.used());
    acts = Arena("a", ma.used());
    model.layout_parameters(params, grads);
    model.layout_activations(acts);
  }
};

using ModelInArenas = ChunkInArenas<GPT2>;

// Random values of a scale where every nonlinearity matters (the GPT-2 init
// is nearly linear at test sizes, which would hide mistakes): LayerNorm
// and RMSNorm weights 1 + 0.3 N(0, 1), everything else 0.3 N(0, 1). Each value is a
// function of (seed, name, global element index), so shards are slices of
// the unsharded model. Gradients are zeroed.
inline void randomize_parameters(ModelChunk& m, uint64_t seed) {
  for (auto& p : m.parameters()) {
    const bool is_norm = p.name.find("ln_") != std::string::npos || p.name.find("layernorm") != std::string::npos ||
                         p.name == "norm.weight";
    const bool norm_weight = is_norm && p.name.find("weight") != std::string::npos;
    const uint64_t s = name_stream(p.name);
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      const int64_t g = p.shard.global_index(p.value.shape(), i);
      const double v = (norm_weight ? 1.0 : 0.0) + 0.3 * rng_normal(seed, s, uint64_t(g));
      if (m.dtype() == DType::F64) p.value.data<double>()[i] = v;
      else p.value.data<float>()[i] = float(v);
    }
    std::memset(p.grad.raw(), 0, p.grad.bytes());
  }
}

}  // namespace xirang
