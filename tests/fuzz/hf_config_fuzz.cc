// Fuzz target: a Hugging Face config.json beside an imported safetensors
// file, checked against the model it must describe (the file adapters'
// hf_config_problem, models/file_adapter.h), as a tiny GPT-2 and a tiny
// LLaMA. Any text must give "" (it matches) or a problem line, never a
// crash or an exception.
#include <cstdint>
#include <vector>

#include "models/file_adapter.h"
#include "models/model.h"
#include "runtime/config/config.h"
#include "runtime/config/model_layout.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace xirang;

struct Tiny {
  ModelDims dims;
  const ModelFileAdapter* files;
};
std::vector<Tiny> models;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  for (const char* yaml : {"model:\n  arch: gpt2\n  n_layer: 1\n  n_head: 2\n  d_model: 8\n  seq_len: 4\n"
                           "  vocab_size: 10\n  vocab_multiple: 4\n",
                           "model:\n  arch: llama\n  n_layer: 1\n  n_head: 2\n  n_kv_head: 1\n  d_model: 8\n"
                           "  ffn_multiple_of: 8\n  seq_len: 4\n  vocab_size: 10\n  vocab_multiple: 4\n"}) {
    const ModelDims dims = parse_config(yaml).model;
    models.push_back({dims, &file_adapter(model_arch(dims.arch))});
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = fuzz::text(data, size);
  for (const Tiny& t : models) fuzz::expect_errors([&] { (void)t.files->hf_config_problem(text, t.dims); });
  return 0;
}
