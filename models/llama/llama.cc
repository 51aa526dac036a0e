#include "models/llama/llama.h"

#include <string>

#include "models/llama/llama_files.h"

namespace xirang {

int llama_ffn_hidden(int d_model, int multiple_of, double ffn_dim_multiplier) {
  XR_CHECK(d_model >= 1 && multiple_of >= 1, "llama_ffn_hidden: d_model ", d_model, ", multiple_of ", multiple_of);
  int64_t hidden = 2 * (4 * int64_t(d_model)) / 3;
  if (ffn_dim_multiplier > 0) hidden = int64_t(ffn_dim_multiplier * double(hidden));
  hidden = (hidden + multiple_of - 1) / multiple_of * multiple_of;
  return int(hidden);
}

int llama_ffn_hidden(const ModelDims& d) {
  return d.ffn_hidden > 0 ? d.ffn_hidden : llama_ffn_hidden(d.d_model, d.ffn_multiple_of, d.ffn_dim_multiplier);
}

namespace {

std::vector<KeyRule> llama_key_rules(const ModelDims& d) {
  std::vector<KeyRule> r = {
      KeyRule::at_least("model.ffn_hidden", d.ffn_hidden, 0,
                        " (0 applies Meta's rule: model.ffn_multiple_of, ffn_dim_multiplier)"),
      KeyRule::at_least("model.ffn_multiple_of", d.ffn_multiple_of, 1),
      KeyRule::non_negative("model.ffn_dim_multiplier", d.ffn_dim_multiplier, " (0 is none)"),
      KeyRule::above("model.rope_theta", d.rope.theta, 1),
      KeyRule::positive("model.norm_eps", d.norm_eps),
  };
  const RopeScaling& s = d.rope.scaling;
  if (s.type == RopeScaling::Type::Llama3) {
    r.push_back(KeyRule::positive("model.rope_scaling.factor", s.factor));
    r.push_back(KeyRule::positive("model.rope_scaling.low_freq_factor", s.low_freq_factor));
    r.push_back(KeyRule::positive("model.rope_scaling.original_max_position_embeddings",
                                  s.original_max_position_embeddings));
    r.push_back(KeyRule::below_other("model.rope_scaling.low_freq_factor", s.low_freq_factor,
                                     "model.rope_scaling.high_freq_factor", s.high_freq_factor));
  }
  return r;
}

}  // namespace

DecoderSpec llama_spec(const ModelDims& d) {
  DecoderSpec s;
  s.name = "Llama";
  s.norm = NormKind::RMSNorm;
  s.ffn = FfnKind::SwiGlu;
  // Config validation reads the spec's key rules before ffn_multiple_of is known to be valid.
  s.ffn_hidden = d.ffn_hidden > 0 || d.ffn_multiple_of >= 1 ? llama_ffn_hidden(d) : 0;
  s.bias = false;
  s.rotary = true;
  s.grouped_query = true;
  s.tied = d.tie_embeddings.value_or(false);
  s.names = {.embed = "embed_tokens.weight", .positions = "", .block = "layers.", .norm1 = "input_layernorm",
             .qkv = "self_attn.qkv_proj", .proj = "self_attn.o_proj", .norm2 = "post_attention_layernorm",
             .up = "mlp.gate_up_proj", .down = "mlp.down_proj", .final_norm = "norm", .head = "lm_head.weight"};
  // Every weight N(0, 0.02), as transformers' LlamaPreTrainedModel.
  s.weight = s.residual = InitRule::normal(0.02);
  s.ffn_keys = d.ffn_hidden > 0 ? "model.ffn_hidden" : "model.ffn_multiple_of and ffn_dim_multiplier";
  s.key_rules = llama_key_rules;
  if (d.moe.num_experts > 0) {
    // model.moe picks the mixture-of-experts feed-forward (Mixtral's shape;
    // with model.moe.shared_hidden, DeepSeek's shared experts too).
    s.ffn = FfnKind::Moe;
    if (d.moe.expert_hidden > 0) s.ffn_hidden = d.moe.expert_hidden;
    s.names.up = "mlp.experts.gate_up_proj";
    s.names.down = "mlp.experts.down_proj";
    if (d.moe.expert_hidden > 0) s.ffn_keys = "model.moe.expert_hidden";
  }
  return s;
}

// Meta's models as their Hugging Face config.json files state them.
std::vector<ModelPreset> llama_presets() {
  const RopeConfig llama2{10000, {}}, llama3{500000, {}};
  const RopeConfig llama31{500000, RopeScaling::llama3(8, 1, 4, 8192)}, llama32{500000, RopeScaling::llama3(32, 1, 4, 8192)};
  auto llama = [](const char* name, const char* what, int layers, int heads, int kv, int width, int ffn, int vocab,
                  int seq, RopeConfig rope, bool tied) {
    return ModelPreset{name, what, {.arch = "llama", .preset = name, .n_layer = layers, .n_head = heads,
                                    .n_kv_head = kv, .d_model = width, .ffn_hidden = ffn, .max_seq_len = seq,
                                    .vocab_size = vocab, .rope = rope, .norm_eps = 1e-5, .tie_embeddings = tied}};
  };
  return {llama("llama2_7b", "Llama 2 7B", 32, 32, 32, 4096, 11008, 32000, 4096, llama2, false),
          llama("llama3_8b", "Llama 3 8B", 32, 32, 8, 4096, 14336, 128256, 8192, llama3, false),
          llama("llama3_70b", "Llama 3 70B", 80, 64, 8, 8192, 28672, 128256, 8192, llama3, false),
          llama("llama3.1_8b", "Llama 3.1 8B", 32, 32, 8, 4096, 14336, 128256, 131072, llama31, false),
          llama("llama3.2_1b", "Llama 3.2 1B", 16, 32, 8, 2048, 8192, 128256, 131072, llama32, true)};
}

ModelArch llama_arch() {
  ModelArch a = decoder_arch("llama", llama_spec, &llama_file_adapter());
  a.presets = llama_presets();
  return a;
}

}  // namespace xirang
