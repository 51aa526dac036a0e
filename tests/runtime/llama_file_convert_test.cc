// LLaMA to and from Hugging Face safetensors (LlamaForCausalLM): the
// exported names and shapes against a list written here, for a tied and an
// untied head; export -> import bitwise, into other layouts and dtypes;
// resharding a LLaMA checkpoint; Hugging Face variants; every refusal.
#include <gtest/gtest.h>

#include "tests/runtime/convert_fixture.h"

namespace xirang::convert_test {
namespace {

// 2 layers, 4 query heads sharing 2 key/value heads of 4, MLP width 48,
// a vocabulary of 250 padded to 256, Llama 3.1 rope scaling.
constexpr char kLlamaYaml[] =
    "model:\n  arch: llama\n  n_layer: 2\n  n_head: 4\n  n_kv_head: 2\n  d_model: 16\n  ffn_hidden: 48\n"
    "  seq_len: 16\n  vocab_size: 250\n  vocab_multiple: 128\n  rope_theta: 500000\n"
    "  rope_scaling:\n    type: llama3\n    factor: 4\n    low_freq_factor: 1\n    high_freq_factor: 4\n"
    "    original_max_position_embeddings: 16\n  norm_eps: 1.0e-6\n  tie_embeddings: false\n";

Config llama_config(bool tied, const std::vector<std::string>& overrides = {}) {
  std::vector<std::string> o = overrides;
  o.insert(o.begin(), std::string("model.tie_embeddings=") + (tied ? "true" : "false"));
  return parse_config(kLlamaYaml, o, "llama.yaml");
}

using Shapes = std::map<std::string, std::vector<int64_t>>;

// LlamaForCausalLM's tensors for the model above, written out by hand.
Shapes llama_tensors(bool tied) {
  Shapes s{{"model.embed_tokens.weight", {250, 16}}, {"model.norm.weight", {16}}};
  for (const std::string l : {"0", "1"}) {
    const std::string p = "model.layers." + l + ".";
    s[p + "input_layernorm.weight"] = {16};
    s[p + "self_attn.q_proj.weight"] = {16, 16};
    s[p + "self_attn.k_proj.weight"] = {8, 16};
    s[p + "self_attn.v_proj.weight"] = {8, 16};
    s[p + "self_attn.o_proj.weight"] = {16, 16};
    s[p + "post_attention_layernorm.weight"] = {16};
    s[p + "mlp.gate_proj.weight"] = {48, 16};
    s[p + "mlp.up_proj.weight"] = {48, 16};
    s[p + "mlp.down_proj.weight"] = {16, 48};
  }
  if (!tied) s["lm_head.weight"] = {250, 16};
  return s;
}

Shapes header_shapes(const StFile& f) {
  Shapes out;
  for (const auto& [k, v] : f.header.items())
    if (k != "__metadata__") out[k] = v["shape"].get<std::vector<int64_t>>();
  return out;
}

// The source's parameters stored as Hugging Face does, built by hand:
// q/k/v and gate/up split by rows, vocab_size rows; `prefix` before every
// name but lm_head.weight.
std::vector<StIn> hf_llama_layout(const Source& s, const std::string& prefix, DType dtype) {
  std::vector<StIn> out;
  const std::string dt = dtype == DType::F32 ? "F32" : "BF16";
  auto rows = [&](const std::string& param, int64_t begin, int64_t end, int64_t cols) {
    const std::vector<float>& v = s.param.at(param);
    return std::vector<float>(v.begin() + begin * cols, v.begin() + end * cols);
  };
  for (const Parameter& p : s.params) {
    const std::string& n = p.name;
    const int64_t cols = p.shard.global.rank() == 2 ? p.shard.global[1] : 1;
    auto put = [&](const std::string& name, int64_t begin, int64_t end) {
      std::vector<int64_t> shape{end - begin};
      if (p.shard.global.rank() == 2) shape.push_back(cols);
      out.push_back({name, dt, shape, raw_of(rows(n, begin, end, cols), dtype)});
    };
    auto renamed = [&](const std::string& from, const std::string& to) {
      return prefix + n.substr(0, n.find(from)) + to + n.substr(n.find(from) + from.size());
    };
    if (n.ends_with("qkv_proj.weight")) {
      put(renamed("qkv_proj", "q_proj"), 0, 16);
      put(renamed("qkv_proj", "k_proj"), 16, 24);
      put(renamed("qkv_proj", "v_proj"), 24, 32);
    } else if (n.ends_with("gate_up_proj.weight")) {
      put(renamed("gate_up_proj", "gate_proj"), 0, 48);
      put(renamed("gate_up_proj", "up_proj"), 48, 96);
    } else if (n == "embed_tokens.weight" || n == "lm_head.weight") {
      put(n == "lm_head.weight" ? n : prefix + n, 0, 250);
    } else {
      put(prefix + n, 0, p.shard.global[0]);
    }
  }
  return out;
}

std::vector<float> bf16_rounded(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  const std::string half = raw_of(v, DType::BF16);
  convert_elements(half.data(), DType::BF16, out.data(), DType::F32, int64_t(v.size()));
  return out;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

class LlamaHf : public testing::TestWithParam<bool> {};  // tied

TEST_P(LlamaHf, ExportHasLlamaForCausalLMNamesAndShapesAndImportsBackBitwise) {
  const bool tied = GetParam();
  const std::string dir = fresh_test_dir("llama_st");
  const Config cfg = llama_config(tied);
  const Source s = make_source(21, cfg);
  write_source(s, dir + "/ck", 7, true, cfg);
  const ConvertResult res = export_hf_safetensors(dir + "/ck", dir + "/hf/model.safetensors", {});
  const Shapes want = llama_tensors(tied);
  EXPECT_EQ(res.tensors, int64_t(want.size()));
  const StFile f = read_st(dir + "/hf/model.safetensors");
  EXPECT_EQ(header_shapes(f), want);
  for (const auto& [name, shape] : want) EXPECT_EQ(f.header[name]["dtype"], "F32") << name;

  // Hand-picked elements: q, k and v are rows [0, 16), [16, 24), [24, 32) of
  // qkv_proj (16 columns); gate and up rows [0, 48), [48, 96) of gate_up_proj.
  const auto& qkv = s.param.at("layers.1.self_attn.qkv_proj.weight");
  EXPECT_EQ(f.at("model.layers.1.self_attn.q_proj.weight", 5 * 16 + 3), qkv[5 * 16 + 3]);
  EXPECT_EQ(f.at("model.layers.1.self_attn.k_proj.weight", 2 * 16 + 9), qkv[(16 + 2) * 16 + 9]);
  EXPECT_EQ(f.at("model.layers.1.self_attn.v_proj.weight", 7 * 16 + 15), qkv[(24 + 7) * 16 + 15]);
  const auto& gu = s.param.at("layers.0.mlp.gate_up_proj.weight");
  EXPECT_EQ(f.at("model.layers.0.mlp.gate_proj.weight", 47 * 16 + 1), gu[47 * 16 + 1]);
  EXPECT_EQ(f.at("model.layers.0.mlp.up_proj.weight", 0 * 16 + 4), gu[(48 + 0) * 16 + 4]);
  const auto& down = s.param.at("layers.0.mlp.down_proj.weight");
  EXPECT_EQ(f.at("model.layers.0.mlp.down_proj.weight", 3 * 48 + 40), down[3 * 48 + 40]) << "(out, in) as ours";
  EXPECT_EQ(f.at("model.embed_tokens.weight", 249 * 16 + 2), s.param.at("embed_tokens.weight")[249 * 16 + 2]);
  if (!tied) {
    EXPECT_EQ(f.at("lm_head.weight", 100 * 16 + 6), s.param.at("lm_head.weight")[100 * 16 + 6]);
  }

  const nlohmann::json c = read_json(dir + "/hf/config.json");
  EXPECT_EQ(c["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(c["model_type"], "llama");
  EXPECT_EQ(c["hidden_size"], 16);
  EXPECT_EQ(c["intermediate_size"], 48);
  EXPECT_EQ(c["num_attention_heads"], 4);
  EXPECT_EQ(c["num_key_value_heads"], 2);
  EXPECT_EQ(c["num_hidden_layers"], 2);
  EXPECT_EQ(c["head_dim"], 4);
  EXPECT_EQ(c["vocab_size"], 250);
  EXPECT_EQ(c["max_position_embeddings"], 16);
  EXPECT_EQ(c["rms_norm_eps"], 1e-6);
  EXPECT_EQ(c["rope_theta"], 500000);
  EXPECT_EQ(c["rope_scaling"], nlohmann::json::parse(R"({"rope_type": "llama3", "factor": 4, "low_freq_factor": 1,
                                                         "high_freq_factor": 4, "original_max_position_embeddings": 16})"));
  EXPECT_EQ(c["tie_word_embeddings"], tied);
  EXPECT_EQ(c["torch_dtype"], "float32");
  EXPECT_EQ(c["hidden_act"], "silu");

  // Import back: bitwise every parameter (padding rows zero in both), parameters only, step 0.
  const ConvertResult imp = import_model_file(dir + "/hf/model.safetensors", cfg, dir + "/back", {});
  const CheckpointReader r = CheckpointReader::open(imp.path);
  EXPECT_EQ(r.step(), 0);
  EXPECT_EQ(r.meta().config_yaml, cfg.yaml);
  ASSERT_EQ(r.entries().size(), s.params.size());
  for (const Parameter& p : s.params) EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name))) << p.name;

  // Into tp=2 (q/k/v split by heads over the ranks), pp=2, and as bf16.
  for (const CheckpointLayout& layout : {CheckpointLayout{1, 2, 1, 0, 1, false}, CheckpointLayout{2, 1, 2, 1, 1, false}}) {
    ConvertOptions o;
    o.layout = layout;
    const std::string out = dir + "/back_" + std::to_string(layout.tp) + std::to_string(layout.pp);
    const CheckpointReader rl = CheckpointReader::open(import_model_file(dir + "/hf/model.safetensors", cfg, out, o).path);
    EXPECT_EQ(int(rl.meta().rank_files.size()), layout.world_size());
    for (const Parameter& p : s.params)
      EXPECT_TRUE(bitwise_equal(read_whole(rl, "params", p), s.param.at(p.name))) << p.name << " tp " << layout.tp;
  }
  ConvertOptions bf16;
  bf16.dtype = DType::BF16;
  bf16.layout = CheckpointLayout{1, 2, 1, 0, 1, false};
  const CheckpointReader rb = CheckpointReader::open(import_model_file(dir + "/hf/model.safetensors", cfg, dir + "/bf16", bf16).path);
  for (const CheckpointEntry& e : rb.entries()) EXPECT_EQ(e.dtype, DType::BF16) << e.name;
  for (const Parameter& p : s.params)
    EXPECT_TRUE(bitwise_equal(read_whole(rb, "params", p), bf16_rounded(s.param.at(p.name)))) << p.name;
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, LlamaHf, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& i) { return i.param ? "tied" : "untied"; });

TEST(LlamaConvert, ReshardKeepsEveryValueAndBf16ExportRounds) {
  const std::string dir = fresh_test_dir("llama_reshard");
  const Config cfg = llama_config(false);
  const Source s = make_source(31, cfg);
  write_source(s, dir + "/ck", 3, true, cfg);
  ConvertOptions o;
  o.layout = CheckpointLayout{2, 2, 2, 1, 1, false};
  const CheckpointReader r = CheckpointReader::open(reshard_checkpoint(dir + "/ck", dir + "/tp2pp2", o).path);
  EXPECT_EQ(r.step(), 3);
  EXPECT_EQ(r.meta().rank_files.size(), 8u);
  for (const Parameter& p : s.params) {
    EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), s.param.at(p.name))) << p.name;
    EXPECT_TRUE(bitwise_equal(read_whole(r, "adam_m", p), s.m.at(p.name))) << p.name;
    EXPECT_TRUE(bitwise_equal(read_whole(r, "adam_v", p), s.v.at(p.name))) << p.name;
  }
  // And exported from that layout in bf16: each stored element is ours rounded once.
  ConvertOptions b;
  b.dtype = DType::BF16;
  export_hf_safetensors(dir + "/tp2pp2", dir + "/hf/model.safetensors", b);
  const StFile f = read_st(dir + "/hf/model.safetensors");
  EXPECT_EQ(header_shapes(f), llama_tensors(false));
  EXPECT_EQ(f.header["model.layers.1.self_attn.k_proj.weight"]["dtype"], "BF16");
  const std::vector<float> k = bf16_rounded(s.param.at("layers.1.self_attn.qkv_proj.weight"));
  EXPECT_EQ(f.at("model.layers.1.self_attn.k_proj.weight", 3 * 16 + 11), k[(16 + 3) * 16 + 11]);
  EXPECT_EQ(read_json(dir + "/hf/config.json")["torch_dtype"], "bfloat16");
}

TEST(LlamaConvert, ImportAcceptsHuggingFaceVariants) {
  // LlamaModel's names (no "model."), bf16, rotary buffers of older files;
  // tied, a lm_head equal to the token table.
  const std::string dir = fresh_test_dir("llama_variants");
  for (const bool tied : {false, true}) {
    const Config cfg = llama_config(tied);
    const Source s = make_source(41, cfg);
    std::vector<StIn> t = hf_llama_layout(s, tied ? "model." : "", DType::BF16);
    for (const std::string l : {"0", "1"})
      t.push_back({"model.layers." + l + ".self_attn.rotary_emb.inv_freq", "F32", {2}, raw_of({1.0f, 0.01f}, DType::F32)});
    if (tied) {
      std::vector<float> head = s.param.at("embed_tokens.weight");
      head.resize(250 * 16);
      t.push_back({"lm_head.weight", "BF16", {250, 16}, raw_of(head, DType::BF16)});
    }
    const std::string st = dir + (tied ? "/tied" : "/untied") + "/model.safetensors";
    write_st(st, t);
    const CheckpointReader r =
        CheckpointReader::open(import_model_file(st, cfg, dir + (tied ? "/imp_tied" : "/imp_untied"), {}).path);
    for (const Parameter& p : s.params)
      EXPECT_TRUE(bitwise_equal(read_whole(r, "params", p), bf16_rounded(s.param.at(p.name)))) << p.name;
  }
}

TEST(LlamaConvert, BadInputsAreRefusedWithOneClearLine) {
  const std::string dir = fresh_test_dir("llama_bad");
  const Config cfg = llama_config(false);
  const Source s = make_source(51, cfg);
  write_source(s, dir + "/ck", 2, true, cfg);
  export_hf_safetensors(dir + "/ck", dir + "/hf/model.safetensors", {});
  fs::create_directories(dir + "/bare");
  fs::copy_file(dir + "/hf/model.safetensors", dir + "/bare/model.safetensors");  // without config.json

  // Another architecture: GPT-2's file into a LLaMA config, and LLaMA's into GPT-2's.
  const Source g = make_source(52);
  write_source(g, dir + "/gpt2ck", 2);
  export_hf_safetensors(dir + "/gpt2ck", dir + "/gpt2/model.safetensors", {});
  expect_error([&] { import_model_file(dir + "/gpt2/model.safetensors", cfg, dir + "/o", {}); }, ErrorKind::Data,
               {"gpt2/config.json': architectures is [\"GPT2LMHeadModel\"], a model other than the config's: "
                "model.arch=llama reads LlamaForCausalLM"});
  fs::remove(dir + "/gpt2/config.json");
  expect_error([&] { import_model_file(dir + "/gpt2/model.safetensors", cfg, dir + "/o", {}); }, ErrorKind::Data,
               {"tensor 'transformer.", "is no parameter of the LLaMA the config describes"});
  expect_error([&] { import_model_file(dir + "/hf/model.safetensors", test_config(), dir + "/o", {}); }, ErrorKind::Data,
               {"hf/config.json': architectures is [\"LlamaForCausalLM\"], a model other than the config's: "
                "model.arch=gpt2 reads GPT2LMHeadModel"});
  expect_error([&] { import_model_file(dir + "/bare/model.safetensors", test_config(), dir + "/o", {}); },
               ErrorKind::Data, {"bare/model.safetensors': tensor 'model.", "is no parameter of the GPT-2"});

  // config.json against the config: the field, its value, the key and the config's value.
  expect_error([&] { import_model_file(dir + "/hf/model.safetensors", llama_config(false, {"model.n_kv_head=4"}), dir + "/o", {}); },
               ErrorKind::Data, {"config.json': num_key_value_heads is 2 but the config has model.n_kv_head=4"});
  expect_error([&] { import_model_file(dir + "/hf/model.safetensors", llama_config(false, {"model.rope_theta=10000"}), dir + "/o", {}); },
               ErrorKind::Data, {"config.json': rope_theta is 500000 but the config has model.rope_theta=10000"});
  expect_error([&] { import_model_file(dir + "/hf/model.safetensors", llama_config(true), dir + "/o", {}); },
               ErrorKind::Data, {"config.json': tie_word_embeddings is false but the config has model.tie_embeddings=true"});

  // Without config.json, the shapes: one line naming the tensor, the stored and the expected shape.
  expect_error([&] { import_model_file(dir + "/bare/model.safetensors", llama_config(false, {"model.n_kv_head=4"}), dir + "/o", {}); },
               ErrorKind::Data, {"tensor 'model.layers.0.self_attn.k_proj.weight' has shape (8, 16), expected (16, 16)",
                                 "n_layer=2"});
  expect_error([&] { import_model_file(dir + "/bare/model.safetensors", llama_config(false, {"model.ffn_hidden=32"}), dir + "/o", {}); },
               ErrorKind::Data, {"tensor 'model.layers.0.mlp.down_proj.weight' has shape (16, 48), expected (16, 32)"});
  // An untied head into a tied model.
  expect_error([&] { import_model_file(dir + "/bare/model.safetensors", llama_config(true), dir + "/o", {}); },
               ErrorKind::Data, {"'lm_head.weight' differs from the token table; LLaMA supports only a copy tied to it"});
  // A part missing, and a part twice (prefixed and not).
  std::vector<StIn> t = hf_llama_layout(s, "model.", DType::F32);
  std::vector<StIn> missing = t;
  missing.erase(std::find_if(missing.begin(), missing.end(),
                             [](const StIn& x) { return x.name == "model.layers.1.self_attn.v_proj.weight"; }));
  write_st(dir + "/missing/model.safetensors", missing);
  expect_error([&] { import_model_file(dir + "/missing/model.safetensors", cfg, dir + "/o", {}); }, ErrorKind::Data,
               {"has no tensor 'model.layers.1.self_attn.v_proj.weight' (nor 'layers.1.self_attn.v_proj.weight')"});
  std::vector<StIn> twice = t;
  twice.push_back(t[2]);
  twice.back().name = twice.back().name.substr(6);
  write_st(dir + "/twice/model.safetensors", twice);
  expect_error([&] { import_model_file(dir + "/twice/model.safetensors", cfg, dir + "/o", {}); }, ErrorKind::Data,
               {"holds '" + t[2].name + "' twice"});
  // llm.c has no LLaMA form.
  std::vector<int32_t> h(256, 0);
  h[0] = 20240326;
  h[1] = 3;
  std::ofstream(dir + "/llama.bin", std::ios::binary).write(reinterpret_cast<const char*>(h.data()), 1024);
  expect_error([&] { import_model_file(dir + "/llama.bin", cfg, dir + "/o", {}); }, ErrorKind::Data,
               {"llama.bin': llm.c model files hold GPT-2 only; model.arch=llama is imported from Hugging Face "
                "safetensors instead"});
  EXPECT_FALSE(fs::exists(dir + "/o")) << "a failed import leaves nothing behind";
}

}  // namespace
}  // namespace xirang::convert_test
