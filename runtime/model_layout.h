// runtime/model_layout.h: how a configuration becomes GPT2 pipeline chunks.
//
// The trainer builds its chunks from these, and so does the offline
// checkpoint converter (runtime/checkpoint_convert.h) when it writes what
// each rank of another layout holds: one definition of the layer split keeps
// the two from drifting apart.
//
//   GPT2Shape shape = gpt2_shape(cfg.model);
//   int g = model_chunk(pp, pp_rank, c);                        // runtime/schedule.h
//   GPT2Stage stage = pipeline_chunk_stage(shape.n_layer, pp * v, g);
#pragma once

#include "models/gpt2.h"
#include "runtime/config.h"

namespace xirang {

inline GPT2Shape gpt2_shape(const ModelConfig& m) {
  GPT2Shape s;
  s.n_layer = m.n_layer;
  s.n_head = m.n_head;
  s.d_model = m.d_model;
  s.max_seq_len = m.seq_len;
  s.vocab_size = m.vocab_size;
  s.padded_vocab = m.padded_vocab();
  return s;
}

// Model chunk g of `chunks` (= pp x virtual stages): an equal share of the
// layers (validate() requires n_layer % chunks == 0); the first chunk holds
// the embedding, the last the final norm and the head.
inline GPT2Stage pipeline_chunk_stage(int n_layer, int chunks, int g) {
  const int per_chunk = n_layer / chunks;
  return GPT2Stage{g * per_chunk, (g + 1) * per_chunk, g == 0, g == chunks - 1};
}

}  // namespace xirang
