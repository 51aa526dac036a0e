#include "models/qwen3/qwen3_files.h"

#include <memory>

#include "models/llama/llama_files.h"

namespace xirang {

const ModelFileAdapter& qwen3_file_adapter() {
  static const std::unique_ptr<ModelFileAdapter> adapter =
      make_llama_family_files({.model_name = "Qwen3",
                               .architecture = "Qwen3ForCausalLM",
                               .model_type = "qwen3",
                               .off = {{"attention_bias", "bias-free projections"},
                                       {"use_sliding_window", "full attention in every layer"}}});
  return *adapter;
}

}  // namespace xirang
