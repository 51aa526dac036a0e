// Fuzz target: foreign model files as `xirang ckpt convert` imports them
// (runtime/checkpoint/model_files.h): Hugging Face safetensors (the 8-byte
// header length, the JSON header, every tensor's dtype, shape and offsets)
// and llm.c files (the 1024-byte header and the sizes it implies). The input
// is the whole file; it is read as a tiny GPT-2 and as a tiny LLaMA, and
// must load or be refused with xirang::Error.
//
// XIRANG_FUZZ_WRITE_SEEDS=DIR fuzz_model_file writes valid files for both
// models into DIR (the seeds in corpus/model_file/), their config.json into
// DIR/../hf_config/ when it exists (corpus/hf_config/), and exits.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <vector>

#include "models/file_adapter.h"
#include "models/model.h"
#include "runtime/checkpoint/checkpoint_convert.h"
#include "runtime/checkpoint/model_files.h"
#include "runtime/config/config.h"
#include "runtime/config/model_layout.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace xirang;
namespace fs = std::filesystem;

const char* kGpt2 = "model:\n  arch: gpt2\n  n_layer: 1\n  n_head: 2\n  d_model: 8\n  seq_len: 4\n"
                    "  vocab_size: 10\n  vocab_multiple: 4\n";
const char* kLlama = "model:\n  arch: llama\n  n_layer: 1\n  n_head: 2\n  n_kv_head: 1\n  d_model: 8\n"
                     "  ffn_multiple_of: 8\n  seq_len: 4\n  vocab_size: 10\n  vocab_multiple: 4\n";

struct Tiny {
  Config config;
  ModelDims dims;
  const ModelFileAdapter* files;
};
std::vector<Tiny> models;
std::string file;  // this process's scratch file

void write_seeds(const std::string& dir) {
  fs::create_directories(dir);
  for (const Tiny& t : models) {
    const std::vector<Parameter> params = rank_parameters(t.dims, CheckpointLayout{}, 0);
    auto fill = [](const Parameter& p, std::vector<float>& v) {
      v.assign(size_t(p.shard.global.numel()), 0.0f);
      for (size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * float(int(i % 17) - 8);
    };
    for (DType dt : {DType::F32, DType::BF16}) {
      const std::string name = dir + "/" + t.dims.arch + "_" + dtype_name(dt);
      write_hf_safetensors(name + ".safetensors", name + ".config.json", t.dims, *t.files, params, dt, 0, fill);
      // The config.json beside them seeds the hf_config target.
      const fs::path config_seed = fs::path(dir) / ".." / "hf_config" / (t.dims.arch + "_config.json");
      if (fs::is_directory(config_seed.parent_path())) fs::copy_file(name + ".config.json", config_seed,
                                                                     fs::copy_options::overwrite_existing);
      fs::remove(name + ".config.json");
    }
    if (t.dims.arch != "gpt2") continue;
    // An llm.c fp32 file: the 256-int32 header, then the tensors it implies.
    LlmcHeader h{};
    h[0] = kLlmcMagic;
    h[1] = 3;
    h[2] = t.dims.max_seq_len;
    h[3] = t.dims.vocab_size;
    h[4] = t.dims.n_layer;
    h[5] = t.dims.n_head;
    h[6] = t.dims.d_model;
    h[7] = t.dims.vocab_size + 2;  // llm.c pads the vocabulary its own way
    int64_t count = 0;
    for (const LlmcTensor& x : t.files->llmc_tensors(h, params, t.dims)) count += x.stored.shape.numel();
    std::vector<float> values(static_cast<size_t>(count));
    for (size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * float(int(i % 13) - 6);
    std::ofstream out(dir + "/gpt2_llmc_fp32.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(h.data()), sizeof h);
    out.write(reinterpret_cast<const char*>(values.data()), std::streamsize(values.size() * sizeof(float)));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  for (const char* yaml : {kGpt2, kLlama}) {
    Tiny t;
    t.config = parse_config(yaml);
    t.dims = t.config.model;
    t.files = &file_adapter(model_arch(t.dims.arch));
    models.push_back(std::move(t));
  }
  if (const char* dir = std::getenv("XIRANG_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  // No config.json beside it: the file alone is under test (tests/fuzz/hf_config_fuzz.cc does config.json).
  const fs::path scratch = fs::temp_directory_path() / ("xirang_fuzz_model_file." + std::to_string(::getpid()));
  fs::create_directories(scratch);
  file = (scratch / "model.bin").string();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  for (const Tiny& t : models)
    fuzz::expect_errors([&] {
      const std::optional<ModelFormat> format = sniff_model_file(file);
      HostModel m{rank_parameters(t.dims, CheckpointLayout{}, 0), {}};
      if (format == ModelFormat::Safetensors) read_hf_safetensors(file, t.config.model, *t.files, m);
      else if (format == ModelFormat::LlmC) read_llmc_model(file, t.config.model, *t.files, m);
    });
  return 0;
}
