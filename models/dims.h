// models/dims.h: a model's hyperparameters, the config's `model` section.
//
// One struct serves every architecture; each reads the fields it uses
// (GPT-2: no n_kv_head, ffn_hidden = 4 d_model) and refuses, through its
// key rules (ModelArch::key_rules), the ones that would change it. The
// config schema (runtime/config/config.cc) points its model.* keys at these
// fields, so what a YAML file says is what a chunk is built from.
//
// A preset is a published model's dims under a name (model.preset:
// llama3_8b); the architecture that owns it lists it (ModelArch::presets).
//
//   ModelDims d = find_model_preset("qwen3_0.6b")->dims;   // models/model.h
//   d.n_layer = 2;                                          // the keys after it
#pragma once

#include <optional>
#include <string>

#include "kernels/moe.h"
#include "kernels/rope.h"

namespace xirang {

// model.moe.aux_loss: the balance loss added to the training objective
// (Switch Transformer's, over the whole microbatch; DeepSeek-V3's
// sequence-wise form, per sequence), or none.
enum class MoeAuxLoss { None, Sequence, Global };

// model.moe: the mixture-of-experts feed-forward (models/layers/moe_ffn.h)
// of an architecture that has one; num_experts = 0 keeps the dense one.
struct MoeDims {
  int num_experts = 0;    // E; 0: a dense feed-forward
  int top_k = 2;          // experts per token
  int expert_hidden = 0;  // F of each expert; 0: the architecture's dense ffn width
  int shared_hidden = 0;  // width of the shared experts (one GatedMlp, added); 0: none
  RouterScore score = RouterScore::Softmax;
  bool normalize = true;  // gates divided by the sum of the selected scores
  // gamma of the auxiliary-loss-free balancing: the selection bias moves by
  // it after each optimizer step (DeepSeek-V3 sec 2.1.2: 0.001); 0: off.
  double bias_update_rate = 0.001;
  MoeAuxLoss aux_loss = MoeAuxLoss::None;
  double aux_loss_coeff = 0.0001;  // alpha
  bool force_balance = false;      // token t -> experts (t k + j) mod E (tests: exactly equal loads)
};

struct ModelDims {
  std::string arch = "gpt2";
  std::string preset;      // the preset the other fields started from ("": none)
  int n_layer = 12;
  int n_head = 12;
  int n_kv_head = 0;       // key/value heads (grouped-query attention); 0: n_head
  int head_dim = 0;        // width of an attention head; 0: d_model / n_head
  int d_model = 768;
  int ffn_hidden = 0;      // MLP hidden width; 0: the architecture's default
  int max_seq_len = 1024;  // the longest sequence, model.seq_len (GPT-2: rows of the position table)
  int vocab_size = 50257;  // real tokens; the model pads to padded_vocab()
  int vocab_multiple = 128;  // the vocabulary is padded to a multiple of this
  // LLaMA: the MLP width when ffn_hidden is 0 (Meta's rule: 2/3 of 4 d_model,
  // times ffn_dim_multiplier when > 0, rounded up to a multiple of ffn_multiple_of).
  int ffn_multiple_of = 256;
  double ffn_dim_multiplier = 0;  // 0: none (Llama 3 8B: 1.3 with multiple_of 1024 gives 14336)
  RopeConfig rope{};        // LLaMA: rotary theta and frequency scaling (model.rope_theta, model.rope_scaling)
  double norm_eps = 1e-5;   // LLaMA: RMSNorm epsilon
  // The head shares the token table. Unset (model.tie_embeddings: auto):
  // the architecture's default (GPT-2 always ties; LLaMA unties).
  std::optional<bool> tie_embeddings{};
  MoeDims moe{};            // the mixture of experts (architectures with one: llama, qwen3)
  int padded_vocab() const { return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int head_size() const { return head_dim > 0 ? head_dim : d_model / n_head; }
};

// A published model's shape.
struct ModelPreset {
  std::string name;  // model.preset
  std::string what;  // the model it reproduces, for `--help` and messages ("Llama 3 8B")
  ModelDims dims;    // every field, arch and preset included
};

}  // namespace xirang
