// runtime/config/model_layout.h: the model a configuration describes.
//
// The trainer builds its chunks from these, and so does the offline
// checkpoint converter when it lists what each rank of another layout
// holds: one translation of the config keeps the two from drifting apart.
//
//   ModelDims dims = model_dims(cfg.model);
//   check_layout(dims, parallel_layout(cfg.parallel));    // models/model.h
#pragma once

#include "models/model.h"
#include "runtime/config/config.h"

namespace xirang {

inline ModelDims model_dims(const ModelConfig& m) {
  ModelDims d;
  d.arch = m.arch;
  d.n_layer = m.n_layer;
  d.n_head = m.n_head;
  d.d_model = m.d_model;
  d.max_seq_len = m.seq_len;
  d.vocab_size = m.vocab_size;
  d.vocab_multiple = m.vocab_multiple;
  return d;
}

inline ParallelLayout parallel_layout(const ParallelConfig& p) {
  return ParallelLayout{p.dp, p.tp, p.pp, p.virtual_stages};
}

}  // namespace xirang
