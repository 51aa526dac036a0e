// LLaMA's file adapter (models/llama/llama_files.h), without files: the
// Hugging Face names, the row blocks of the fused q/k/v and gate/up
// projections, config.json and its checks, the llm.c refusal; Qwen3's
// (models/qwen3/qwen3_files.h), the same adapter for another family member.
#include "models/llama/llama_files.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "models/llama/llama.h"
#include "models/qwen3/qwen3.h"
#include "models/qwen3/qwen3_files.h"
#include "tests/support/expect_error.h"

namespace xirang {
namespace {

// 2 layers, 4 query heads sharing 2 key/value heads of 4, MLP width 48,
// a vocabulary of 250 padded to 256, Llama 3.1 rope scaling.
ModelDims dims(bool tied) {
  ModelDims d{.arch = "llama", .n_layer = 2, .n_head = 4, .n_kv_head = 2, .d_model = 16, .ffn_hidden = 48,
              .max_seq_len = 16, .vocab_size = 250};
  d.rope = RopeConfig{500000.0, RopeScaling::llama3(4, 1, 4, 16)};
  d.norm_eps = 1e-6;
  d.tie_embeddings = tied;
  return d;
}

std::vector<Parameter> one_rank(const ModelDims& d) { return llama_parameters(d, ChunkPlacement::whole(d.n_layer), 1, 0); }

const Parameter& param(const std::vector<Parameter>& ps, const std::string& name) {
  for (const Parameter& p : ps)
    if (p.name == name) return p;
  throw std::runtime_error("no parameter " + name);
}

TEST(LlamaFiles, RegisteredForLlama) { EXPECT_EQ(model_arch("llama").files, &llama_file_adapter()); }

TEST(LlamaFiles, FusedProjectionsAreStoredAsRowBlocks) {
  const ModelDims d = dims(false);
  const ModelFileAdapter& a = llama_file_adapter();
  const std::vector<Parameter> ps = one_rank(d);
  const std::vector<ForeignTensor> qkv = a.hf_tensors(param(ps, "layers.1.self_attn.qkv_proj.weight"), d);
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_EQ(qkv[0].names, (std::vector<std::string>{"model.layers.1.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight"}));
  EXPECT_EQ(qkv[1].names[0], "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(qkv[2].names[0], "model.layers.1.self_attn.v_proj.weight");
  EXPECT_EQ(qkv[0].shape, (Shape{16, 16}));
  EXPECT_EQ(qkv[1].shape, (Shape{8, 16}));
  EXPECT_EQ(qkv[2].shape, (Shape{8, 16}));
  EXPECT_EQ(std::make_pair(qkv[0].row_begin, qkv[0].row_end), std::make_pair(int64_t(0), int64_t(16)));
  EXPECT_EQ(std::make_pair(qkv[1].row_begin, qkv[1].row_end), std::make_pair(int64_t(16), int64_t(24)));
  EXPECT_EQ(std::make_pair(qkv[2].row_begin, qkv[2].row_end), std::make_pair(int64_t(24), int64_t(32)));
  const std::vector<ForeignTensor> gu = a.hf_tensors(param(ps, "layers.0.mlp.gate_up_proj.weight"), d);
  ASSERT_EQ(gu.size(), 2u);
  EXPECT_EQ(gu[0].names[0], "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(gu[1].names[0], "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(gu[0].shape, (Shape{48, 16}));
  EXPECT_EQ(std::make_pair(gu[1].row_begin, gu[1].row_end), std::make_pair(int64_t(48), int64_t(96)));
  for (const ForeignTensor& t : qkv) EXPECT_EQ(t.layout, ForeignLayout::Same) << "Linear keeps (out, in) like ours";

  const ForeignTensor embed = a.hf_tensors(param(ps, "embed_tokens.weight"), d).at(0);
  EXPECT_EQ(embed.names, (std::vector<std::string>{"model.embed_tokens.weight", "embed_tokens.weight"}));
  EXPECT_EQ(embed.layout, ForeignLayout::RealRows);
  EXPECT_EQ(embed.shape, (Shape{250, 16}));
  const ForeignTensor head = a.hf_tensors(param(ps, "lm_head.weight"), d).at(0);
  EXPECT_EQ(head.names, (std::vector<std::string>{"lm_head.weight"}));
  EXPECT_EQ(head.shape, (Shape{250, 16}));
  EXPECT_EQ(a.hf_tensors(param(ps, "norm.weight"), d).at(0).names[0], "model.norm.weight");
  EXPECT_EQ(a.hf_tensors(param(ps, "layers.1.self_attn.o_proj.weight"), d).at(0).names[0],
            "model.layers.1.self_attn.o_proj.weight");
}

TEST(LlamaFiles, ExtraTensors) {
  const ModelFileAdapter& a = llama_file_adapter();
  const ExtraTensor head = a.hf_extra("lm_head.weight");
  EXPECT_EQ(head.kind, ExtraTensor::Kind::TiedCopy);
  EXPECT_EQ(head.param, "embed_tokens.weight");
  for (const char* buffer : {"model.layers.0.self_attn.rotary_emb.inv_freq", "layers.11.self_attn.rotary_emb.inv_freq"})
    EXPECT_EQ(a.hf_extra(buffer).kind, ExtraTensor::Kind::Ignored) << buffer;
  for (const char* other : {"transformer.wte.weight", "model.layers.0.self_attn.qkv_proj.weight",
                            "model.layers.x.self_attn.rotary_emb.inv_freq", "score.weight"})
    EXPECT_EQ(a.hf_extra(other).kind, ExtraTensor::Kind::Unknown) << other;
}

TEST(LlamaFiles, ConfigJson) {
  const ModelFileAdapter& a = llama_file_adapter();
  const nlohmann::json c = nlohmann::json::parse(a.hf_config_json(dims(false), DType::BF16));
  const nlohmann::json want = nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 48,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 4, "vocab_size": 250,
    "max_position_embeddings": 16, "rms_norm_eps": 1e-06, "rope_theta": 500000,
    "rope_scaling": {"rope_type": "llama3", "factor": 4, "low_freq_factor": 1, "high_freq_factor": 4,
                     "original_max_position_embeddings": 16},
    "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false, "mlp_bias": false,
    "attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "bfloat16"})");
  EXPECT_EQ(c, want) << c.dump(2);
  ModelDims plain = dims(true);
  plain.rope = RopeConfig{};
  const nlohmann::json t = nlohmann::json::parse(a.hf_config_json(plain, DType::F32));
  EXPECT_TRUE(t["rope_scaling"].is_null());
  EXPECT_EQ(t["tie_word_embeddings"], true);
  EXPECT_EQ(t["rope_theta"], 10000);
  EXPECT_EQ(t["torch_dtype"], "float32");
}

TEST(LlamaFiles, ConfigJsonIsCheckedAgainstTheConfig) {
  const ModelFileAdapter& a = llama_file_adapter();
  const ModelDims d = dims(false);
  const std::string ours = a.hf_config_json(d, DType::F32);
  EXPECT_EQ(a.hf_config_problem(ours, d), "");
  auto with = [&](const std::string& pointer, nlohmann::json value) {
    nlohmann::json j = nlohmann::json::parse(ours);
    j[nlohmann::json::json_pointer(pointer)] = value;
    return a.hf_config_problem(j.dump(), d);
  };
  auto without = [&](const char* field) {
    nlohmann::json j = nlohmann::json::parse(ours);
    j.erase(field);
    return a.hf_config_problem(j.dump(), d);
  };
  EXPECT_EQ(with("/num_key_value_heads", 4), "num_key_value_heads is 4 but the config has model.n_kv_head=2");
  EXPECT_EQ(with("/hidden_size", 32), "hidden_size is 32 but the config has model.d_model=16");
  EXPECT_EQ(with("/intermediate_size", 64), "intermediate_size is 64 but the config has model.ffn_hidden=48");
  EXPECT_EQ(with("/num_hidden_layers", 3), "num_hidden_layers is 3 but the config has model.n_layer=2");
  EXPECT_EQ(with("/vocab_size", 256), "vocab_size is 256 but the config has model.vocab_size=250");
  EXPECT_EQ(with("/rms_norm_eps", 1e-5), "rms_norm_eps is 1e-05 but the config has model.norm_eps=1e-06");
  EXPECT_EQ(with("/rope_theta", 10000.0), "rope_theta is 10000.0 but the config has model.rope_theta=500000");
  EXPECT_EQ(with("/tie_word_embeddings", true),
            "tie_word_embeddings is true but the config has model.tie_embeddings=false");
  EXPECT_EQ(with("/rope_scaling/factor", 8.0), "rope_scaling.factor is 8.0 but the config has model.rope_scaling.factor=4");
  EXPECT_EQ(with("/rope_scaling/original_max_position_embeddings", 8192),
            "rope_scaling.original_max_position_embeddings is 8192 but the config has "
            "model.rope_scaling.original_max_position_embeddings=16");
  EXPECT_EQ(with("/rope_scaling", nullptr), "rope_scaling has rope_type none but the config has model.rope_scaling.type=llama3");
  EXPECT_EQ(with("/rope_scaling/rope_type", "yarn"),
            "rope_scaling has rope_type \"yarn\"; model.rope_scaling.type is none or llama3");
  EXPECT_EQ(with("/hidden_act", "gelu"), "hidden_act is \"gelu\"; model.arch=llama computes SwiGLU (\"silu\")");
  EXPECT_EQ(with("/attention_bias", true), "attention_bias is true; model.arch=llama has bias-free projections");
  EXPECT_EQ(with("/mlp_bias", true), "mlp_bias is true; model.arch=llama has bias-free projections");
  EXPECT_EQ(with("/model_type", "gpt2"),
            "model_type is \"gpt2\", a model other than the config's: model.arch=llama reads \"llama\"");
  EXPECT_EQ(with("/architectures", {"GPT2LMHeadModel"}),
            "architectures is [\"GPT2LMHeadModel\"], a model other than the config's: model.arch=llama reads "
            "LlamaForCausalLM");
  // Absent fields: transformers' defaults where they matter, else nothing to compare.
  EXPECT_EQ(without("head_dim"), "");
  EXPECT_EQ(without("max_position_embeddings"), "");
  EXPECT_EQ(without("rms_norm_eps"), "") << "1e-6, LlamaConfig's default, is the config's";
  EXPECT_EQ(without("rope_theta"), "rope_theta is absent (10000) but the config has model.rope_theta=500000");
  EXPECT_EQ(without("rope_scaling"), "rope_scaling has rope_type none but the config has model.rope_scaling.type=llama3");
  EXPECT_EQ(with("/rope_scaling/rope_type", "default"),
            "rope_scaling has rope_type none but the config has model.rope_scaling.type=llama3");
  const ModelDims tied = dims(true);
  nlohmann::json j = nlohmann::json::parse(a.hf_config_json(tied, DType::F32));
  j.erase("tie_word_embeddings");
  EXPECT_EQ(a.hf_config_problem(j.dump(), tied),
            "tie_word_embeddings is absent (false) but the config has model.tie_embeddings=true");
  ModelDims rule = d;
  rule.ffn_hidden = 0;  // Meta's rule: 2/3 of 64 = 42, up to a multiple of 256
  EXPECT_EQ(a.hf_config_problem(ours, rule),
            "intermediate_size is 48 but the config has model.ffn_multiple_of=256 and ffn_dim_multiplier=0, an MLP "
            "width=256");
}

TEST(LlamaFiles, LlmcHasNoLlamaForm) {
  const ModelDims d = dims(false);
  EXPECT_EQ(llama_file_adapter().llmc_header_problem(LlmcHeader{}, d),
            "llm.c model files hold GPT-2 only; model.arch=llama is imported from Hugging Face safetensors instead");
  expect_error([&] { llama_file_adapter().llmc_tensors(LlmcHeader{}, one_rank(d), d); }, ErrorKind::Data,
               {"llm.c", "GPT-2 only"});
}

// Qwen3: the dims above with heads 6 wide (q 24, k and v 12 rows of 16) and a tied head.
ModelDims qwen3_dims() {
  ModelDims d = dims(true);
  d.arch = "qwen3";
  d.head_dim = 6;
  d.rope = RopeConfig{1000000.0, {}};
  return d;
}

TEST(Qwen3Files, NamesAndShapesWithTheQkNorm) {
  EXPECT_EQ(model_arch("qwen3").files, &qwen3_file_adapter());
  const ModelDims d = qwen3_dims();
  const ModelFileAdapter& a = qwen3_file_adapter();
  EXPECT_EQ(a.model_name(), "Qwen3");
  const std::vector<Parameter> ps = model_arch("qwen3").parameters(d, ChunkPlacement::whole(d.n_layer), 1, 0);
  const std::vector<ForeignTensor> qkv = a.hf_tensors(param(ps, "layers.1.self_attn.qkv_proj.weight"), d);
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_EQ(qkv[0].names[0], "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(qkv[0].shape, (Shape{24, 16}));
  EXPECT_EQ(qkv[1].names[0], "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(qkv[1].row_begin, 24);
  EXPECT_EQ(qkv[2].row_end, 48);
  const std::vector<ForeignTensor> qn = a.hf_tensors(param(ps, "layers.0.self_attn.q_norm.weight"), d);
  ASSERT_EQ(qn.size(), 1u);
  EXPECT_EQ(qn[0].names, (std::vector<std::string>{"model.layers.0.self_attn.q_norm.weight",
                                                   "layers.0.self_attn.q_norm.weight"}));
  EXPECT_EQ(qn[0].shape, (Shape{6}));
  EXPECT_EQ(a.hf_tensors(param(ps, "layers.1.self_attn.o_proj.weight"), d)[0].shape, (Shape{16, 24}));
}

TEST(Qwen3Files, ConfigJsonAndItsChecks) {
  const ModelFileAdapter& a = qwen3_file_adapter();
  const ModelDims d = qwen3_dims();
  const std::string ours = a.hf_config_json(d, DType::BF16);
  const nlohmann::json c = nlohmann::json::parse(ours);
  const nlohmann::json want = nlohmann::json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 16, "intermediate_size": 48,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 6, "vocab_size": 250,
    "max_position_embeddings": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": null,
    "tie_word_embeddings": true, "hidden_act": "silu", "attention_bias": false, "use_sliding_window": false,
    "attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "bfloat16"})");
  EXPECT_EQ(c, want) << c.dump(2);
  EXPECT_EQ(a.hf_config_problem(ours, d), "");
  auto with = [&](const std::string& pointer, nlohmann::json value) {
    nlohmann::json j = nlohmann::json::parse(ours);
    j[nlohmann::json::json_pointer(pointer)] = value;
    return a.hf_config_problem(j.dump(), d);
  };
  EXPECT_EQ(with("/head_dim", 4), "head_dim is 4 but the config has model.head_dim=6");
  EXPECT_EQ(with("/use_sliding_window", true),
            "use_sliding_window is true; model.arch=qwen3 has full attention in every layer");
  EXPECT_EQ(with("/attention_bias", true), "attention_bias is true; model.arch=qwen3 has bias-free projections");
  EXPECT_EQ(with("/architectures", {"LlamaForCausalLM"}),
            "architectures is [\"LlamaForCausalLM\"], a model other than the config's: model.arch=qwen3 reads "
            "Qwen3ForCausalLM");
  EXPECT_EQ(with("/model_type", "qwen2"),
            "model_type is \"qwen2\", a model other than the config's: model.arch=qwen3 reads \"qwen3\"");
  // A LLaMA's config.json is not a Qwen3's, and the other way round.
  EXPECT_NE(llama_file_adapter().hf_config_problem(ours, dims(true)), "");
  EXPECT_NE(a.hf_config_problem(llama_file_adapter().hf_config_json(dims(true), DType::F32), d), "");
}

}  // namespace
}  // namespace xirang
