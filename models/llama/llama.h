// models/llama/llama.h: the LLaMA family (Llama 2, Llama 3) as a decoder
// spec (models/decoder/decoder_chunk.h).
//
// Architecture: no position table; pre-RMSNorm blocks (norm_eps) with a
// fused, bias-free q/k/v projection whose q and k heads are rotated (RoPE,
// rope_theta and Llama 3.1 frequency scaling: kernels/rope.h), causal
// grouped-query attention (n_kv_head key/value heads shared by n_head query
// heads), a bias-free output projection, and a SwiGLU MLP of width
// ffn_hidden (packed [gate; up] projection, down projection); a final
// RMSNorm; an LM head that is its own table (lm_head) unless
// tie_embeddings. Every weight is drawn N(0, 0.02), norms start at 1, as
// transformers' LlamaPreTrainedModel does.
//
// Parameter names follow Hugging Face's LlamaModel with q/k/v and gate/up
// fused: embed_tokens.weight, layers.{i}.input_layernorm.weight,
// layers.{i}.self_attn.qkv_proj.weight ([q; k; v] rows: n_head D, then
// n_kv_head D twice), layers.{i}.self_attn.o_proj.weight,
// layers.{i}.post_attention_layernorm.weight,
// layers.{i}.mlp.gate_up_proj.weight ([gate; up] rows, F each),
// layers.{i}.mlp.down_proj.weight, norm.weight, lm_head.weight.
//
// Tensor parallelism: qkv_proj column-parallel in three unequal blocks (q,
// k, v: each split by heads, so tp divides n_head and n_kv_head),
// gate_up_proj column-parallel in two blocks (a rank holds [Wg_r; Wu_r]),
// o_proj and down_proj row-parallel, the token table and lm_head split by
// vocabulary rows, the RMSNorm regions split by token rows under sequence
// parallelism.
//
//   ModelDims dims = {.arch = "llama", .n_layer = 32, .n_head = 32, .n_kv_head = 8, .d_model = 4096, ...};
//   Llama model(dims, ChunkPlacement::whole(dims.n_layer), DType::BF16, {.micro_batch = 1, .seq_len = 8192});
#pragma once

#include <string>
#include <vector>

#include "models/decoder/decoder_chunk.h"

namespace xirang {

// The registry entry of model.arch=llama (models/model.cc lists it).
ModelArch llama_arch();
DecoderSpec llama_spec(const ModelDims& dims);

// Meta's MLP width: hidden = int(2 (4 d_model) / 3), times ffn_dim_multiplier
// when > 0 (truncated), rounded up to a multiple of multiple_of. 14336 for
// Llama 3 8B (4096, 1.3, 1024), 11008 for Llama 2 7B (4096, none, 256).
int llama_ffn_hidden(int d_model, int multiple_of, double ffn_dim_multiplier);
// dims.ffn_hidden, or the rule above from dims' multiple_of and multiplier.
int llama_ffn_hidden(const ModelDims& dims);

using Llama = SpecChunk<llama_spec>;
inline std::vector<Parameter> llama_parameters(const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank) {
  return decoder_parameters(llama_spec(d), d, at, tp, tp_rank);
}

}  // namespace xirang
