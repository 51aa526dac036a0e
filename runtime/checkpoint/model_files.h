// runtime/checkpoint/model_files.h: the model file formats the checkpoint converter
// reads and writes (runtime/checkpoint/checkpoint_convert.h is the API to use).
//
// Hugging Face safetensors: an 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets}} (plus "__metadata__"), then the
// raw little-endian data.
//
// llm.c model files: 256 int32 of header (magic 20240326, version 3 = fp32
// or 5 = bf16, then fields of the model), then every parameter's raw values
// in the model's order.
//
// These functions own the containers only. Which tensor is which parameter,
// in which shape and layout, what the llm.c header fields mean and what
// config.json says come from the architecture's adapter (ModelArch::files,
// models/file_adapter.h).
//
//   HostModel m{rank_parameters(dims, CheckpointLayout{}, 0), {}};   // one-rank order
//   const ModelFileAdapter& files = file_adapter(model_arch(dims.arch));
//   read_hf_safetensors("model.safetensors", cfg.model, files, m);    // m.values: our global layout, f32
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "runtime/checkpoint/checkpoint_convert.h"
#include "runtime/config/config.h"

namespace xirang {

inline constexpr int32_t kLlmcMagic = 20240326;

// A whole model in host memory: the one-rank parameter list and each
// parameter's values in our global layout, f32.
struct HostModel {
  std::vector<Parameter> params;
  std::vector<std::vector<float>> values;  // values[i]: params[i].shard.global.numel() elements
};

// Safetensors or llm.c, when the first bytes say so; nullopt otherwise.
std::optional<ModelFormat> sniff_model_file(const std::string& path);

// Fills m.values from a Hugging Face safetensors file. A config.json in the
// same directory is checked against `model` first (a Data error naming the
// field and both values, or the other architecture it describes); then
// every tensor's shape, before reading any data (Data errors name the
// tensor, its shape and the one expected). Every parameter, or each of its
// parts, must be stored once under one of its adapter names; a tensor the
// adapter calls a tied copy must equal its parameter, one it ignores is
// skipped, any other is an error. Padding rows the file lacks are zero.
void read_hf_safetensors(const std::string& path, const ModelDims& model, const ModelFileAdapter& files,
                         HostModel& m);
// Fills m.values from an llm.c model file whose header must match `model`.
void read_llmc_model(const std::string& path, const ModelDims& model, const ModelFileAdapter& files, HostModel& m);

// Writes `params` (the one-rank list; read_global fills a parameter's global
// f32 values) as Hugging Face safetensors in `dtype` (f32, bf16, f16) at
// `path`, named and laid out by `files`, and its config.json at
// `config_json`; both appear atomically. Returns the number of tensors written
// (a parameter stored in parts counts each).
int64_t write_hf_safetensors(const std::string& path, const std::string& config_json, const ModelDims& dims,
                             const ModelFileAdapter& files, const std::vector<Parameter>& params, DType dtype,
                             int64_t step, const std::function<void(const Parameter&, std::vector<float>&)>& read_global);

// fsyncs a directory (after a rename inside it); errors are ignored.
void sync_directory(const std::string& dir);

}  // namespace xirang
