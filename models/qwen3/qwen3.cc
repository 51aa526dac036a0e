#include "models/qwen3/qwen3.h"

#include "models/llama/llama.h"
#include "models/qwen3/qwen3_files.h"

namespace xirang {

DecoderSpec qwen3_spec(const ModelDims& d) {
  DecoderSpec s = llama_spec(d);
  s.name = "Qwen3";
  s.qk_norm = true;
  s.names.q_norm = "self_attn.q_norm";
  s.names.k_norm = "self_attn.k_norm";
  return s;
}

// Qwen's dense models as their config.json files state them: heads of 128, 8
// key/value heads, 151936 tokens, 40960 positions, theta 1e6, eps 1e-6.
std::vector<ModelPreset> qwen3_presets() {
  auto qwen3 = [](const char* name, const char* what, int layers, int heads, int width, int ffn, bool tied) {
    return ModelPreset{name, what, {.arch = "qwen3", .preset = name, .n_layer = layers, .n_head = heads,
                                    .n_kv_head = 8, .head_dim = 128, .d_model = width, .ffn_hidden = ffn,
                                    .max_seq_len = 40960, .vocab_size = 151936, .rope = {1e6, {}},
                                    .norm_eps = 1e-6, .tie_embeddings = tied}};
  };
  return {qwen3("qwen3_0.6b", "Qwen3 0.6B", 28, 16, 1024, 3072, true),
          qwen3("qwen3_1.7b", "Qwen3 1.7B", 28, 16, 2048, 6144, true),
          qwen3("qwen3_4b", "Qwen3 4B", 36, 32, 2560, 9728, true),
          qwen3("qwen3_8b", "Qwen3 8B", 36, 32, 4096, 12288, false)};
}

ModelArch qwen3_arch() {
  ModelArch a = decoder_arch("qwen3", qwen3_spec, &qwen3_file_adapter());
  a.presets = qwen3_presets();
  return a;
}

}  // namespace xirang
