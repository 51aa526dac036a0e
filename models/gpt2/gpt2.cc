#include "models/gpt2/gpt2.h"

#include <algorithm>
#include <string>

#include "models/gpt2/gpt2_files.h"

namespace xirang {

namespace {

// GPT-2 has none of LLaMA's options; the ones that would change it are refused.
std::vector<KeyRule> gpt2_key_rules(const ModelDims& d) {
  std::vector<KeyRule> rules;
  if (d.n_kv_head != 0 && d.n_kv_head != d.n_head)
    rules.push_back(KeyRule::refused("model.n_kv_head", str_cat("model.n_kv_head=", d.n_kv_head,
                                                                ": model.arch=gpt2 has no grouped-query attention (0 "
                                                                "or model.n_head)")));
  if (d.head_dim != 0 && d.head_dim * d.n_head != d.d_model)
    rules.push_back(KeyRule::refused("model.head_dim", str_cat("model.head_dim=", d.head_dim,
                                                               ": model.arch=gpt2's heads are d_model / n_head wide (0 "
                                                               "or ", d.d_model / std::max(d.n_head, 1), ")")));
  if (d.tie_embeddings == false)
    rules.push_back(KeyRule::refused("model.tie_embeddings",
                                     "model.tie_embeddings=false: model.arch=gpt2 always ties its head to the token "
                                     "table"));
  return rules;
}

}  // namespace

// The decoder's defaults are GPT-2's choices: LayerNorm, a GELU MLP, biases,
// learned positions, a tied head.
DecoderSpec gpt2_spec(const ModelDims& d) {
  DecoderSpec s;
  s.name = "GPT2";
  s.ffn_hidden = 4 * d.d_model;
  s.ffn_keys = "4 x model.d_model";
  s.grouped_query = false;
  s.names = {.embed = "wte.weight", .positions = "wpe.weight", .block = "h.", .norm1 = "ln_1",
             .qkv = "attn.c_attn", .proj = "attn.c_proj", .norm2 = "ln_2", .up = "mlp.c_fc",
             .down = "mlp.c_proj", .final_norm = "ln_f", .head = ""};
  s.residual = InitRule::scaled_residual(0.02, d.n_layer);  // N(0, 0.02 / sqrt(2 n_layer))
  s.key_rules = gpt2_key_rules;
  return s;
}

// OpenAI's four sizes (Hugging Face gpt2, gpt2-medium, gpt2-large, gpt2-xl):
// 1024 positions, 50257 tokens, the defaults of ModelDims.
std::vector<ModelPreset> gpt2_presets() {
  auto gpt2 = [](const char* name, const char* what, int layers, int heads, int width) {
    return ModelPreset{name, what, {.arch = "gpt2", .preset = name, .n_layer = layers, .n_head = heads, .d_model = width}};
  };
  return {gpt2("gpt2_124m", "GPT-2 124M", 12, 12, 768), gpt2("gpt2_350m", "GPT-2 Medium (350M)", 24, 16, 1024),
          gpt2("gpt2_774m", "GPT-2 Large (774M)", 36, 20, 1280), gpt2("gpt2_1558m", "GPT-2 XL (1.5B)", 48, 25, 1600)};
}

ModelArch gpt2_arch() {
  ModelArch a = decoder_arch("gpt2", gpt2_spec, &gpt2_file_adapter());
  a.presets = gpt2_presets();
  return a;
}

}  // namespace xirang
