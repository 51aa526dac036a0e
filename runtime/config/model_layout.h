// runtime/config/model_layout.h: the model a configuration describes.
//
// The trainer builds its chunks from these, and so does the offline
// checkpoint converter when it lists what each rank of another layout
// holds: one translation of the config keeps the two from drifting apart.
//
//   ModelDims dims = model_dims(cfg.model);
//   check_layout(dims, parallel_layout(cfg.parallel));    // models/model.h
//   arch.make_chunk(dims, placement, dtype, chunk_batch(cfg, slots), tp);
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
  d.n_kv_head = m.n_kv_head;
  d.head_dim = m.head_dim;
  d.ffn_hidden = m.ffn_hidden;
  d.ffn_multiple_of = m.ffn_multiple_of;
  d.ffn_dim_multiplier = m.ffn_dim_multiplier;
  d.rope.theta = m.rope_theta;
  if (m.rope_scaling_type == RopeScalingType::Llama3)
    d.rope.scaling = RopeScaling::llama3(m.rope_scaling_factor, m.rope_scaling_low_freq_factor,
                                         m.rope_scaling_high_freq_factor,
                                         m.rope_scaling_original_max_position_embeddings);
  d.norm_eps = m.norm_eps;
  if (m.tie_embeddings != TieEmbeddings::Auto) d.tie_embeddings = m.tie_embeddings == TieEmbeddings::True;
  return d;
}

// A chunk's batch: the config's microbatch shape and recompute mode, with `slots` activation slots.
inline ChunkBatch chunk_batch(const Config& c, int slots) {
  return ChunkBatch{c.train.micro_batch, c.seq_len(), slots, c.train.recompute};
}

inline ParallelLayout parallel_layout(const ParallelConfig& p) {
  return ParallelLayout{p.dp, p.tp, p.pp, p.virtual_stages};
}

}  // namespace xirang
