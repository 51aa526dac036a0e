// Conversion to and from foreign model files: Hugging Face safetensors export
// and import (names, Conv1D transposes, vocabulary padding, tied head, mask
// buffers), llm.c import, and every refusal of bad input.
#include <gtest/gtest.h>

#include "tests/runtime/convert_fixture.h"

namespace xirang::convert_test {
namespace {

// The source's parameters the way Hugging Face stores them, built by hand:
// (in, out) block matrices, vocab_size rows.
std::vector<StIn> hf_layout(const Source& s, const std::string& prefix, DType dtype) {
  std::vector<StIn> out;
  for (const Parameter& p : s.params) {
    std::vector<float> v = s.param.at(p.name);
    std::vector<int64_t> shape;
    for (int d = 0; d < p.shard.global.rank(); ++d) shape.push_back(p.shard.global[d]);
    if (p.name == "wte.weight") {
      v.resize(size_t(kV * kC));
      shape = {kV, kC};
    } else if (shape.size() == 2 && p.name.rfind("h.", 0) == 0) {
      v = transpose(v, shape[0], shape[1]);
      std::swap(shape[0], shape[1]);
    }
    out.push_back({prefix + p.name, dtype == DType::F32 ? "F32" : "BF16", shape, raw_of(v, dtype)});
  }
  return out;
}

TEST(CheckpointConvert, SafetensorsExportHasHuggingFaceNamesShapesAndTransposes) {
  const std::string dir = fresh_test_dir("st");
  const Source s = make_source(5);
  write_source(s, dir + "/ck", 11);
  const ConvertResult res = export_hf_safetensors(dir + "/ck", dir + "/hf/model.safetensors", {});
  EXPECT_EQ(res.tensors, 2 + 12 * kL + 2);
  const StFile f = read_st(dir + "/hf/model.safetensors");
  EXPECT_EQ(f.data_start % 8, 0u) << "the data section starts aligned";
  std::set<std::string> names;
  for (const auto& [k, v] : f.header.items())
    if (k != "__metadata__") names.insert(k);
  EXPECT_EQ(names.size(), size_t(2 + 12 * kL + 2));
  EXPECT_FALSE(names.count("lm_head.weight")) << "the tied head is omitted";
  for (const std::string& n : names) {
    EXPECT_EQ(n.rfind("transformer.", 0), 0u) << n;
    EXPECT_EQ(f.header[n]["dtype"], "F32");
  }
  EXPECT_EQ(f.shape("transformer.wte.weight"), (std::vector<int64_t>{kV, kC}));  // unpadded
  EXPECT_EQ(f.shape("transformer.wpe.weight"), (std::vector<int64_t>{kT, kC}));
  EXPECT_EQ(f.shape("transformer.h.1.attn.c_attn.weight"), (std::vector<int64_t>{kC, 3 * kC}));  // (in, out)
  EXPECT_EQ(f.shape("transformer.h.1.attn.c_attn.bias"), (std::vector<int64_t>{3 * kC}));
  EXPECT_EQ(f.shape("transformer.h.2.attn.c_proj.weight"), (std::vector<int64_t>{kC, kC}));
  EXPECT_EQ(f.shape("transformer.h.3.mlp.c_fc.weight"), (std::vector<int64_t>{kC, 4 * kC}));
  EXPECT_EQ(f.shape("transformer.h.0.mlp.c_proj.weight"), (std::vector<int64_t>{4 * kC, kC}));
  EXPECT_EQ(f.shape("transformer.ln_f.bias"), (std::vector<int64_t>{kC}));
  // Hand-picked elements: ours (out, in) element (r, c) is Conv1D's (c, r).
  const auto& qkv = s.param.at("h.1.attn.c_attn.weight");  // (96, 32)
  EXPECT_EQ(f.at("transformer.h.1.attn.c_attn.weight", 5 * (3 * kC) + 70), qkv[70 * kC + 5]);
  EXPECT_EQ(f.at("transformer.h.1.attn.c_attn.weight", 31 * (3 * kC) + 95), qkv[95 * kC + 31]);
  const auto& proj = s.param.at("h.0.mlp.c_proj.weight");  // (32, 128)
  EXPECT_EQ(f.at("transformer.h.0.mlp.c_proj.weight", 100 * kC + 3), proj[3 * (4 * kC) + 100]);
  const auto& attn_proj = s.param.at("h.2.attn.c_proj.weight");  // (32, 32)
  EXPECT_EQ(f.at("transformer.h.2.attn.c_proj.weight", 7 * kC + 2), attn_proj[2 * kC + 7]);
  EXPECT_NE(attn_proj[2 * kC + 7], attn_proj[7 * kC + 2]);
  EXPECT_EQ(f.at("transformer.wte.weight", 249 * kC + 7), s.param.at("wte.weight")[249 * kC + 7]);
  EXPECT_EQ(f.at("transformer.h.3.ln_2.bias", 17), s.param.at("h.3.ln_2.bias")[17]);

  std::ifstream cj(dir + "/hf/config.json");
  const nlohmann::json config = nlohmann::json::parse(cj);
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["n_embd"], kC);
  EXPECT_EQ(config["n_layer"], kL);
  EXPECT_EQ(config["n_head"], 4);
  EXPECT_EQ(config["n_positions"], kT);
  EXPECT_EQ(config["vocab_size"], kV);

  // Import back: bitwise the source parameters (the padding rows are zero in both), at step 0, parameters only.
  const ConvertResult imp = import_model_file(dir + "/hf/model.safetensors", test_config(), dir + "/back", {});
  const CheckpointReader r = CheckpointReader::open(imp.path);
  EXPECT_EQ(r.step(), 0);
  EXPECT_EQ(r.get_int(0, "train.step"), 0);
  EXPECT_EQ(r.meta().config_yaml, test_config().yaml);
  for (const CheckpointEntry& e : r.entries()) EXPECT_EQ(e.group, "params");
  for (const Parameter& p : s.params) EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name))) << p.name;
  // Into a tensor-parallel layout as well.
  ConvertOptions tp2;
  tp2.layout = CheckpointLayout{1, 2, 1, 0, 1, false};
  const CheckpointReader r2 =
      CheckpointReader::open(import_model_file(dir + "/hf/model.safetensors", test_config(), dir + "/back2", tp2).path);
  EXPECT_EQ(r2.meta().rank_files.size(), 2u);
  for (const Parameter& p : s.params) EXPECT_TRUE(bitwise_equal(read_whole(r2, "params", p), s.param.at(p.name))) << p.name;
}

TEST(CheckpointConvert, SafetensorsBf16ExportRoundsLikeConvertElements) {
  const std::string dir = fresh_test_dir("st");
  const Source s = make_source(6);
  write_source(s, dir + "/ck", 1);
  ConvertOptions o;
  o.dtype = DType::BF16;
  export_hf_safetensors(dir + "/ck", dir + "/model.safetensors", o);
  const StFile f = read_st(dir + "/model.safetensors");
  EXPECT_EQ(f.header["transformer.h.0.ln_1.weight"]["dtype"], "BF16");
  const std::string want = raw_of(s.param.at("h.0.ln_1.weight"), DType::BF16);
  const uint64_t b = f.header["transformer.h.0.ln_1.weight"]["data_offsets"][0].get<uint64_t>();
  EXPECT_EQ(f.bytes.substr(f.data_start + b, want.size()), want);
  const auto& qkv = s.param.at("h.3.attn.c_attn.weight");
  float rounded = 0;
  const std::string one = raw_of({qkv[40 * kC + 9]}, DType::BF16);
  convert_elements(one.data(), DType::BF16, &rounded, DType::F32, 1);
  EXPECT_EQ(f.at("transformer.h.3.attn.c_attn.weight", 9 * (3 * kC) + 40), rounded);
  std::ifstream cj(dir + "/config.json");
  EXPECT_EQ(nlohmann::json::parse(cj)["torch_dtype"], "bfloat16");
}

TEST(CheckpointConvert, SafetensorsImportAcceptsHuggingFaceVariants) {
  // No "transformer." prefix, bf16 data, mask buffers of other dtypes, and a
  // lm_head equal to the token table, as Hugging Face files come.
  const std::string dir = fresh_test_dir("st");
  const Source s = make_source(7);
  std::vector<StIn> t = hf_layout(s, "", DType::BF16);
  for (int l = 0; l < kL; ++l) {
    t.push_back({"h." + std::to_string(l) + ".attn.bias", "U8", {1, 1, kT, kT}, std::string(size_t(kT * kT), '\1')});
    t.push_back({"h." + std::to_string(l) + ".attn.masked_bias", "F32", {}, raw_of({-1e4f}, DType::F32)});
  }
  std::vector<float> head = s.param.at("wte.weight");
  head.resize(size_t(kV * kC));
  t.push_back({"lm_head.weight", "BF16", {kV, kC}, raw_of(head, DType::BF16)});
  write_st(dir + "/model.safetensors", t);
  const CheckpointReader r =
      CheckpointReader::open(import_model_file(dir + "/model.safetensors", test_config(), dir + "/imp", {}).path);
  for (const Parameter& p : s.params) {
    const std::vector<float>& src = s.param.at(p.name);
    std::vector<float> want(src.size());
    const std::string half = raw_of(src, DType::BF16);
    convert_elements(half.data(), DType::BF16, want.data(), DType::F32, int64_t(src.size()));
    EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), want)) << p.name;
  }
}

// ---------------------------------------------------------------------------
// llm.c

// An llm.c model file (header of 256 int32, then the parameters in llm.c's
// order) holding the source's values; written here, not by the converter.
void write_llmc(const std::string& path, const Source& s, int version, int32_t magic = 20240326, int n_layer = kL) {
  std::vector<int32_t> h(256, 0);
  h[0] = magic;
  h[1] = version;
  h[2] = kT;
  h[3] = kV;
  h[4] = n_layer;
  h[5] = 4;
  h[6] = kC;
  h[7] = kVp;
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(h.data()), 1024);
  const DType t = version == 3 ? DType::F32 : DType::BF16;
  auto put = [&](const std::vector<float>& v) {
    const std::string raw = raw_of(v, t);
    f.write(raw.data(), std::streamsize(raw.size()));
  };
  // llm.c's padding rows are zero; random ones here show that the import zeroes ours regardless.
  std::vector<float> wte = s.param.at("wte.weight");
  const std::vector<float> noise = random_values((kVp - kV) * kC, 99);
  std::copy(noise.begin(), noise.end(), wte.begin() + kV * kC);
  put(wte);
  put(s.param.at("wpe.weight"));
  for (const char* kind : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                           "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                           "mlp.c_proj.weight", "mlp.c_proj.bias"})
    for (int l = 0; l < kL; ++l) put(s.param.at("h." + std::to_string(l) + "." + kind));
  put(s.param.at("ln_f.weight"));
  put(s.param.at("ln_f.bias"));
}

TEST(CheckpointConvert, LlmcImportGivesTheFilesValuesInOurLayout) {
  const std::string dir = fresh_test_dir("llmc");
  const Source s = make_source(8);
  write_llmc(dir + "/gpt2.bin", s, 3);
  EXPECT_EQ(detect_model_format(dir + "/gpt2.bin"), ModelFormat::LlmC);
  const CheckpointReader r =
      CheckpointReader::open(import_model_file(dir + "/gpt2.bin", test_config(), dir + "/imp", {}).path);
  EXPECT_EQ(r.step(), 0);
  for (const Parameter& p : s.params) EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name))) << p.name;

  // Version 5 holds bf16: the import gives exactly the bf16 values, widened.
  write_llmc(dir + "/gpt2_bf16.bin", s, 5);
  ConvertOptions o;
  o.layout = CheckpointLayout{1, 2, 2, 0, 1, false};
  const CheckpointReader r5 =
      CheckpointReader::open(import_model_file(dir + "/gpt2_bf16.bin", test_config(), dir + "/imp5", o).path);
  for (const Parameter& p : s.params) {
    const std::vector<float>& src = s.param.at(p.name);
    std::vector<float> want(src.size());
    const std::string half = raw_of(src, DType::BF16);
    convert_elements(half.data(), DType::BF16, want.data(), DType::F32, int64_t(src.size()));
    EXPECT_TRUE(bitwise_equal(read_whole(r5, "params", p), want)) << p.name;
  }
}

// ---------------------------------------------------------------------------
// Refusals

TEST(CheckpointConvert, BadInputsAreRefusedWithOneClearMessage) {
  const std::string dir = fresh_test_dir("bad");
  const Source s = make_source(9);
  write_source(s, dir + "/ck", 4);
  const Config cfg = test_config();
  export_hf_safetensors(dir + "/ck", dir + "/hf/model.safetensors", {});
  const std::string st = file_bytes(dir + "/hf/model.safetensors");
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    return dir + "/" + name;
  };

  // Unknown format.
  const std::string text = write("notes.txt", "hello, this is not a model\n");
  expect_error([&] { import_model_file(text, cfg, dir + "/o1", {}); }, ErrorKind::Data, {"notes.txt", "unknown format"});
  expect_error([&] { import_model_file(dir + "/nothing.bin", cfg, dir + "/o1", {}); }, ErrorKind::Data, {"does not exist"});
  // Truncated safetensors, cut inside the data and inside the header.
  const std::string cut = write("cut.safetensors", st.substr(0, st.size() / 2));
  expect_error([&] { import_model_file(cut, cfg, dir + "/o1", {}); }, ErrorKind::Data, {"cut.safetensors", "is truncated"});
  const std::string cut_header = write("cut_header.safetensors", st.substr(0, 40));
  expect_error([&] { import_model_file(cut_header, cfg, dir + "/o1", {}); }, ErrorKind::Data, {"is truncated", "header"});
  // The config says d_model 64: config.json beside the file says otherwise, and without it the shapes do.
  expect_error([&] { import_model_file(dir + "/hf/model.safetensors", test_config({"model.d_model=64"}), dir + "/o1", {}); },
               ErrorKind::Data, {"hf/config.json': n_embd is 32 but the config has model.d_model=64"});
  fs::create_directories(dir + "/bare");
  fs::copy_file(dir + "/hf/model.safetensors", dir + "/bare/model.safetensors");
  expect_error([&] { import_model_file(dir + "/bare/model.safetensors", test_config({"model.d_model=64"}), dir + "/o1", {}); },
               ErrorKind::Data, {"tensor 'transformer.h.0.attn.c_attn.bias' has shape (96), expected (192)", "d_model=64"});
  // Missing tensor.
  std::vector<StIn> t = hf_layout(s, "transformer.", DType::F32);
  t.erase(std::find_if(t.begin(), t.end(), [](const StIn& x) { return x.name == "transformer.h.2.mlp.c_fc.bias"; }));
  write_st(dir + "/missing.safetensors", t);
  expect_error([&] { import_model_file(dir + "/missing.safetensors", cfg, dir + "/o1", {}); }, ErrorKind::Data,
               {"has no tensor 'transformer.h.2.mlp.c_fc.bias'"});
  // An untied head.
  t = hf_layout(s, "transformer.", DType::F32);
  t.push_back({"lm_head.weight", "F32", {kV, kC}, raw_of(random_values(kV * kC, 5), DType::F32)});
  write_st(dir + "/untied.safetensors", t);
  expect_error([&] { import_model_file(dir + "/untied.safetensors", cfg, dir + "/o1", {}); }, ErrorKind::Data,
               {"lm_head.weight", "differs from the token table"});
  // A tensor the model does not have (the file has more layers than the config).
  expect_error([&] { import_model_file(dir + "/hf/model.safetensors", test_config({"model.n_layer=2"}), dir + "/o1", {}); },
               ErrorKind::Data, {"config.json': n_layer is 4 but the config has model.n_layer=2"});
  expect_error([&] { import_model_file(dir + "/bare/model.safetensors", test_config({"model.n_layer=2"}), dir + "/o1", {}); },
               ErrorKind::Data, {"tensor 'transformer.h.2.", "no parameter of the GPT-2", "n_layer=2"});

  // llm.c: wrong magic, truncated, header against the config.
  write_llmc(dir + "/magic.bin", s, 3, /*magic=*/1234);
  expect_error([&] { import_model_file(dir + "/magic.bin", cfg, dir + "/o1", {}); }, ErrorKind::Data,
               {"not an llm.c model file: magic number 1234, expected 20240326"});
  write_llmc(dir + "/good.bin", s, 3);
  const std::string llmc = file_bytes(dir + "/good.bin");
  const std::string short_llmc = write("short.bin", llmc.substr(0, llmc.size() - 100));
  expect_error([&] { import_model_file(short_llmc, cfg, dir + "/o1", {}); }, ErrorKind::Data, {"short.bin", "is truncated"});
  const std::string tiny = write("tiny.bin", llmc.substr(0, 100));
  expect_error([&] { import_model_file(tiny, cfg, dir + "/o1", {}); }, ErrorKind::Data,
               {"is truncated", "1024-byte llm.c header"});
  const std::string longer = write("long.bin", llmc + "xxxx");
  expect_error([&] { import_model_file(longer, cfg, dir + "/o1", {}); }, ErrorKind::Data, {"4 bytes more than"});
  write_llmc(dir + "/layers.bin", s, 3, 20240326, /*n_layer=*/3);
  expect_error([&] { import_model_file(dir + "/layers.bin", cfg, dir + "/o1", {}); }, ErrorKind::Data,
               {"the llm.c header has n_layer 3 but the config has model.n_layer=4"});
  write_llmc(dir + "/version.bin", s, 4);
  expect_error([&] { import_model_file(dir + "/version.bin", cfg, dir + "/o1", {}); }, ErrorKind::Data, {"version 4"});
  // Hostile safetensors headers (found by tests/fuzz): a shape whose element
  // count overflows 64 bits, and data offsets that wrap past 2^64 (the
  // truncation check once added them to the header's end and wrapped).
  auto header_only = [&](const std::string& name, const std::string& json) {
    std::string bytes(8, '\0');
    const uint64_t n = json.size();
    std::memcpy(bytes.data(), &n, 8);
    return write(name, bytes + json);
  };
  const std::string huge = header_only(
      "huge.safetensors", R"({"wte.weight":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,0]}})");
  expect_error([&] { import_model_file(huge, cfg, dir + "/o1", {}); }, ErrorKind::Data,
               {"huge.safetensors", "tensor 'wte.weight' has shape", "more bytes than any file holds"});
  const std::string wrap = header_only(
      "wrap.safetensors",
      R"({"wte.weight":{"dtype":"U8","shape":[4],"data_offsets":[18446744073709551610,18446744073709551614]}})");
  expect_error([&] { import_model_file(wrap, cfg, dir + "/o1", {}); }, ErrorKind::Data,
               {"wrap.safetensors", "is truncated: tensor 'wte.weight' ends at byte 18446744073709551614"});
  EXPECT_FALSE(fs::exists(dir + "/o1")) << "a failed import leaves nothing behind";
  EXPECT_FALSE(fs::exists(dir + "/o1.converting"));

  // A layout the model cannot take.
  ConvertOptions tp3;
  tp3.layout = CheckpointLayout{1, 3, 1, 0, 1, false};
  expect_error([&] { reshard_checkpoint(dir + "/ck", dir + "/o2", tp3); }, ErrorKind::Config,
               {"layout dp=1,tp=3", "model.n_head=4 is not divisible by parallel.tp=3"});

  // Destinations: an existing one needs overwrite; the source is never the destination.
  const auto before = snapshot(dir + "/ck");
  fs::create_directories(dir + "/taken/step_00000001");
  expect_error([&] { reshard_checkpoint(dir + "/ck", dir + "/taken", {}); }, ErrorKind::Data, {"taken", "already exists"});
  ConvertOptions force;
  force.overwrite = true;
  expect_error([&] { reshard_checkpoint(dir + "/ck", dir + "/ck", force); }, ErrorKind::Data, {"is the source"});
  expect_error([&] { reshard_checkpoint(dir + "/ck/step_00000004", dir + "/ck", force); }, ErrorKind::Data,
               {"holds the source"});
  expect_error([&] { reshard_checkpoint(dir + "/ck", dir + "/ck/inner", force); }, ErrorKind::Data, {"inside it"});
  expect_error([&] { export_hf_safetensors(dir + "/ck", dir + "/hf/model.safetensors", {}); }, ErrorKind::Data,
               {"model.safetensors", "already exists"});
  fs::create_directories(dir + "/precious");
  write("precious/notes.txt", "keep me");
  expect_error([&] { reshard_checkpoint(dir + "/ck", dir + "/precious", force); }, ErrorKind::Data,
               {"not a checkpoint directory"});
  EXPECT_EQ(snapshot(dir + "/ck"), before) << "the source changed";
  EXPECT_EQ(file_bytes(dir + "/precious/notes.txt"), "keep me");
  // With overwrite an existing checkpoint root is replaced whole.
  const ConvertResult replaced = reshard_checkpoint(dir + "/ck", dir + "/taken", force);
  EXPECT_FALSE(fs::exists(dir + "/taken/step_00000001"));
  EXPECT_TRUE(fs::exists(replaced.path + "/meta.json"));
  EXPECT_EQ(snapshot(dir + "/ck"), before) << "the source changed";
}

}  // namespace
}  // namespace xirang::convert_test
