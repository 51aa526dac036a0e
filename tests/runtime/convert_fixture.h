// tests/runtime/convert_fixture.h: the model and checkpoints the conversion
// tests share: a 4-layer GPT-2 (d_model 32, a vocabulary of 250 padded to
// 256) with random values, written as a checkpoint, and helpers that read
// files back. Expected layouts are written out by hand, not derived from the
// converter.
//
//   Source s = make_source(/*seed=*/3);
//   std::string ck = write_source(s, dir + "/ck", /*step=*/4);
#pragma once

#include "runtime/checkpoint/checkpoint_convert.h"
#include <gtest/gtest.h>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "comm/process_grid.h"
#include "runtime/checkpoint/hdf5_check.h"
#include "runtime/config/model_layout.h"
#include "tests/support/expect_error.h"
#include "tests/support/temp_dir.h"

namespace xirang::convert_test {

namespace fs = std::filesystem;
using testing_util::fresh_test_dir;

// 4 layers, 4 heads, d_model 32, 16 positions, a vocabulary of 250 padded to 256.
constexpr char kYaml[] =
    "model:\n  n_layer: 4\n  n_head: 4\n  d_model: 32\n  seq_len: 16\n  vocab_size: 250\n  vocab_multiple: 128\n";
constexpr int64_t kL = 4, kC = 32, kT = 16, kV = 250, kVp = 256;

inline Config test_config(const std::vector<std::string>& overrides = {}) { return parse_config(kYaml, overrides, "test.yaml"); }
inline ModelDims test_shape() { return test_config().model; }

// Random values in +-[0.1, 1): never zero, so a missed copy shows.
inline std::vector<float> random_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mag(0.1f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = (rng() & 1 ? 1.0f : -1.0f) * mag(rng);
  return v;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline Tensor view(const std::vector<float>& v, Shape s) { return Tensor(const_cast<float*>(v.data()), s, DType::F32); }
inline ShardSpec whole(const Shape& g) { return ShardSpec::whole(g); }

inline std::vector<std::string> block_names(int l) {
  std::vector<std::string> out;
  for (const char* t : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                        "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                        "mlp.c_proj.weight", "mlp.c_proj.bias"})
    out.push_back("h." + std::to_string(l) + "." + t);
  return out;
}

// The test model's parameters and AdamW moments, random; the token table's
// padding rows are zero, as the trainer keeps them.
struct Source {
  std::vector<Parameter> params;  // one-rank order
  std::map<std::string, std::vector<float>> param, m, v;
};

// `cfg` gives the model (the GPT-2 above unless told); the vocabulary
// tables are wte.weight, embed_tokens.weight and lm_head.weight.
inline Source make_source(uint64_t seed, const Config& cfg = test_config()) {
  Source s;
  const ModelDims& dims = cfg.model;
  s.params = rank_parameters(dims, CheckpointLayout{}, 0);
  for (const Parameter& p : s.params) {
    const int64_t n = p.shard.global.numel();
    s.param[p.name] = random_values(n, ++seed);
    if (p.name == "wte.weight" || p.name == "embed_tokens.weight" || p.name == "lm_head.weight")
      std::fill(s.param[p.name].begin() + dims.vocab_size * p.shard.global[1], s.param[p.name].end(), 0.0f);
    s.m[p.name] = random_values(n, ++seed);
    s.v[p.name] = random_values(n, ++seed);
    for (float& x : s.v[p.name]) x = std::abs(x);
  }
  return s;
}

// Writes `s` as a one-rank checkpoint at `step` under `root`; returns the step directory.
inline std::string write_source(const Source& s, const std::string& root, int64_t step, bool optimizer = true,
                                const Config& cfg = test_config()) {
  CheckpointDir dir(root);
  const std::string tmp = dir.prepare(step);
  RankCheckpointWriter w(tmp, 0, step);
  for (const Parameter& p : s.params) {
    const int64_t n = p.shard.global.numel();
    w.add("params", p.name, p.shard, view(s.param.at(p.name), p.shard.global));
    if (!optimizer) continue;
    w.add("adam_m", p.name, p.shard, 0, n, view(s.m.at(p.name), {n}), DType::F32);
    w.add("adam_v", p.name, p.shard, 0, n, view(s.v.at(p.name), {n}), DType::F32);
  }
  w.set_int("train.step", step);
  w.set_double("test.scale", 0.25);
  w.close();
  CheckpointMeta meta;
  meta.step = step;
  meta.config_yaml = cfg.yaml;
  dir.commit(meta, 0);
  return dir.step_dir(step);
}

inline std::vector<float> read_whole(const CheckpointReader& r, const std::string& group, const Parameter& p) {
  const int64_t n = p.shard.global.numel();
  std::vector<float> out(static_cast<size_t>(n));
  r.read(group, p.name, whole(p.shard.global), Tensor(out.data(), {n}, DType::F32));
  return out;
}

// The values one entry stores, straight from its HDF5 dataset, as f32.
inline std::vector<float> stored_values(const CheckpointEntry& e) {
  Hdf5Scope scope;
  H5Id f(XR_HDF5_ID(H5Fopen(e.file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)), H5Fclose);
  H5Id d(XR_HDF5_ID(H5Dopen2(f, e.dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  std::vector<unsigned char> raw(size_t(e.numel()) * dtype_size(e.dtype));
  XR_HDF5_CHECK(H5Dread(d, e.dtype == DType::F32 ? H5T_NATIVE_FLOAT : H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL,
                        H5P_DEFAULT, raw.data()));
  std::vector<float> out(size_t(e.numel()));
  convert_elements(raw.data(), e.dtype, out.data(), DType::F32, e.numel());
  return out;
}

// Which dimension tensor parallelism splits (docs/architecture.md), -1 replicated.
inline int split_dim(const std::string& name) {
  auto ends = [&](const char* s) { return name.ends_with(s); };
  if (name == "wte.weight" || ends("c_attn.weight") || ends("c_attn.bias") || ends("c_fc.weight") || ends("c_fc.bias"))
    return 0;
  if (ends("attn.c_proj.weight") || ends("mlp.c_proj.weight")) return 1;
  return -1;
}

// (rows, cols) -> (cols, rows), written here independently of the converter.
inline std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

inline std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Every file under `dir` with its content: the source must come out of a conversion untouched.
inline std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[e.path().string()] = file_bytes(e.path().string());
  return out;
}

// ---------------------------------------------------------------------------
// Safetensors files, read and written by the tests themselves

// A safetensors file as read back: its header and bytes.
struct StFile {
  nlohmann::json header;
  std::string bytes;
  uint64_t data_start = 0;
  // Element `index` of tensor `name`'s row-major flat view, as f32.
  float at(const std::string& name, int64_t index) const {
    const auto& t = header.at(name);
    const uint64_t b = t["data_offsets"][0].get<uint64_t>();
    const std::string dt = t["dtype"].get<std::string>();
    const size_t es = dt == "F32" ? 4 : 2;
    float x = 0;
    convert_elements(bytes.data() + data_start + b + size_t(index) * es, dt == "F32" ? DType::F32 : DType::BF16, &x,
                     DType::F32, 1);
    return x;
  }
  std::vector<int64_t> shape(const std::string& name) const { return header.at(name)["shape"].get<std::vector<int64_t>>(); }
};

inline StFile read_st(const std::string& path) {
  StFile f;
  f.bytes = file_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, f.bytes.data(), 8);
  f.header = nlohmann::json::parse(f.bytes.substr(8, n));
  f.data_start = 8 + n;
  return f;
}

// A safetensors file written by the test itself.
struct StIn {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string data;
};

inline std::string raw_of(const std::vector<float>& v, DType t) {
  std::string out(v.size() * dtype_size(t), '\0');
  convert_elements(v.data(), DType::F32, out.data(), t, int64_t(v.size()));
  return out;
}

inline void write_st(const std::string& path, const std::vector<StIn>& tensors) {
  fs::create_directories(fs::path(path).parent_path());
  nlohmann::json h;
  uint64_t off = 0;
  for (const StIn& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", std::vector<uint64_t>{off, off + t.data.size()}}};
    off += t.data.size();
  }
  const std::string text = h.dump();
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = text.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(text.data(), std::streamsize(text.size()));
  for (const StIn& t : tensors) f.write(t.data.data(), std::streamsize(t.data.size()));
}

// ---------------------------------------------------------------------------
// Resharding

}  // namespace xirang::convert_test
