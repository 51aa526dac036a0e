// models/qwen3/qwen3_files.h: Qwen3 in Hugging Face model files
// (Qwen3ForCausalLM), the ModelFileAdapter of model.arch=qwen3.
//
// LLaMA's layout (models/llama/llama_files.h: "model." prefixes, q/k/v and
// gate/up stored split by rows, lm_head absent when tied) plus the q/k norm
// weights under their own names (model.layers.{i}.self_attn.q_norm.weight).
// config.json: Qwen3Config's fields, with head_dim always written;
// attention_bias and use_sliding_window written false and refused when
// true on import (Qwen3 has bias-free projections and full attention in
// every layer).
#pragma once

#include "models/file_adapter.h"

namespace xirang {

const ModelFileAdapter& qwen3_file_adapter();

}  // namespace xirang
