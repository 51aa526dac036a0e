// models/qwen3/qwen3.h: Qwen3 (the dense models: 0.6B to 32B) as a decoder
// spec (models/decoder/decoder_chunk.h).
//
// Architecture: LLaMA's (models/llama/llama.h: pre-RMSNorm blocks, fused
// bias-free q/k/v projection, rotary embeddings, grouped-query attention,
// SwiGLU, final RMSNorm, tied or untied head) with each q and k head
// RMS-normalized over its head_dim before the rotation (q_norm, k_norm:
// head_dim weights each, shared by every head of a layer, initialized to
// 1), and an attention head width model.head_dim that need not be d_model /
// n_head (Qwen3-0.6B: d_model 1024, 16 heads of 128). Every weight N(0,
// 0.02), as transformers' Qwen3PreTrainedModel.
//
// Parameter names: LLaMA's plus layers.{i}.self_attn.q_norm.weight and
// layers.{i}.self_attn.k_norm.weight. Tensor parallelism: LLaMA's; the q/k
// norm weights are replicated, and their gradients summed over the group
// (each rank normalizes its own heads).
//
//   model: {arch: qwen3, n_layer: 28, n_head: 16, n_kv_head: 8, d_model: 1024, head_dim: 128,
//           ffn_hidden: 3072, vocab_size: 151936, rope_theta: 1000000, norm_eps: 1.0e-6, tie_embeddings: true}
#pragma once

#include "models/decoder/decoder_chunk.h"

namespace xirang {

// The registry entry of model.arch=qwen3 (models/model.cc lists it).
ModelArch qwen3_arch();
DecoderSpec qwen3_spec(const ModelDims& dims);

using Qwen3 = SpecChunk<qwen3_spec>;

}  // namespace xirang
