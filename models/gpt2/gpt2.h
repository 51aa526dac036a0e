// models/gpt2/gpt2.h: GPT-2 as a decoder spec (models/decoder/decoder_chunk.h).
//
// Architecture: learned position embeddings; pre-LayerNorm blocks with a
// fused QKV projection, causal multi-head attention and a 4x MLP with GELU
// (tanh form); a final LayerNorm; an LM head tied to the token embedding; the
// vocabulary padded to a multiple of model.vocab_multiple (padding logits
// take no part in the softmax). Parameter names follow Hugging Face's
// GPT2Model ("h.0.attn.c_attn.weight"); projections into the residual
// stream start at N(0, 0.02 / sqrt(2 n_layer)).
//
//   ModelDims dims = {.arch = "gpt2", .n_layer = 12, .n_head = 12, .d_model = 768};
//   GPT2 model(dims, ChunkPlacement::whole(dims.n_layer), DType::F32, {.micro_batch = 4, .seq_len = 256},
//              {.group = &grid.tp(), .sequence_parallel = true});
//   model.layout_parameters(param_arena, grad_arena);   // then as any ModelChunk (models/model.h)
#pragma once

#include <vector>

#include "models/decoder/decoder_chunk.h"

namespace xirang {

// The registry entry of model.arch=gpt2 (models/model.cc lists it).
ModelArch gpt2_arch();
DecoderSpec gpt2_spec(const ModelDims& dims);

// A GPT-2 chunk, and its parameter list for tensor-parallel rank tp_rank of tp (without storage).
using GPT2 = SpecChunk<gpt2_spec>;
inline std::vector<Parameter> gpt2_parameters(const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank) {
  return decoder_parameters(gpt2_spec(d), d, at, tp, tp_rank);
}

}  // namespace xirang
