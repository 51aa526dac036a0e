// models/llama/llama_files.h: LLaMA's names and layouts in Hugging Face
// model files (the ModelFileAdapter of model.arch=llama).
//
// Hugging Face (LlamaForCausalLM): our names with a "model." prefix (imports
// also accept them without, as LlamaModel saves them), except lm_head.weight;
// matrices (out, in) like ours. Our fused projections are stored split by
// rows: layers.{i}.self_attn.qkv_proj.weight as q_proj (n_head D rows),
// k_proj and v_proj (n_kv_head D rows each); layers.{i}.mlp.gate_up_proj.weight
// as gate_proj and up_proj (ffn_hidden rows each). embed_tokens and lm_head
// with vocab_size rows, ours padded. Tied (model.tie_embeddings: true), there
// is no lm_head.weight; one in a file must equal the token table. Rotary
// inverse-frequency buffers (self_attn.rotary_emb.inv_freq, which older
// transformers saved) are ignored.
//
// q_proj and k_proj need no permutation: transformers rotates the q and k it
// computes from the stored weights with rotate_half (pairs (i, i + D/2) of a
// head), and kernels/rope.h rotates the same pairs, so the stored rows are
// ours as they are (tests/models/llama_test.cc checks our forward against a
// transcription of transformers' that rotates (i, i + D/2) on these rows). (Meta's original checkpoints rotate interleaved pairs
// (2i, 2i + 1); transformers' conversion script permutes those rows, and
// files in its format are what this adapter reads.)
//
// config.json: LlamaForCausalLM's fields, rope_scaling null or Llama 3.1's
// {"rope_type": "llama3", ...}; read back on import and checked field by
// field against the config. llm.c's model file has no LLaMA form: its
// methods refuse with one line.
//
// The architectures transformers builds on LLaMA's modules store the same
// tensors under the same names and describe themselves with the same
// config.json fields: an HfLlamaFamily names one (its classes, and the
// switches its config.json has that must be off), and the same adapter
// serves it. Qwen3 (models/qwen3/) adds per-head q/k norm weights, which are
// parameters of the same names and need no entry here.
//
//   ModelArch a = ...;
//   a.files = &llama_file_adapter();
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/file_adapter.h"

namespace xirang {

struct HfLlamaFamily {
  std::string model_name;    // in messages: "LLaMA"
  std::string architecture;  // config.json's architectures[0]: "LlamaForCausalLM"
  std::string model_type;    // "llama"
  // config.json fields written false on export and refused when true on
  // import, each with what the architecture does instead ("bias-free projections").
  struct Off {
    std::string field, instead;
  };
  std::vector<Off> off;
};

const ModelFileAdapter& llama_file_adapter();
// The adapter of a family member's files.
std::unique_ptr<ModelFileAdapter> make_llama_family_files(HfLlamaFamily family);

}  // namespace xirang
