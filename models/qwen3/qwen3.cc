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

ModelArch qwen3_arch() { return decoder_arch("qwen3", qwen3_spec, &qwen3_file_adapter()); }

}  // namespace xirang
