// LLaMA in Hugging Face model files (models/llama/llama_files.h).
#include "models/llama/llama_files.h"

#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/llama/llama.h"
#include "models/model.h"

namespace xirang {

namespace {

constexpr char kHfPrefix[] = "model.";  // LlamaForCausalLM's LlamaModel
constexpr char kTokenTable[] = "embed_tokens.weight";
constexpr char kHead[] = "lm_head.weight";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// `name` with its last occurrence of `from` replaced by `to`.
std::string renamed(const std::string& name, const std::string& from, const std::string& to) {
  const size_t at = name.rfind(from);
  return name.substr(0, at) + to + name.substr(at + from.size());
}

// A buffer older transformers saved: layers.<l>.self_attn.rotary_emb.inv_freq.
bool is_rotary_buffer(const std::string& name) {
  if (name.rfind("layers.", 0) != 0) return false;
  size_t i = 7;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  return i > 7 && name.substr(i) == ".self_attn.rotary_emb.inv_freq";
}

// A number as config.json writes it: an integer when it is one (Llama 3.1's
// original_max_position_embeddings is 8192, not 8192.0).
nlohmann::json number(double x) {
  if (std::floor(x) == x && std::abs(x) < 9e15) return int64_t(x);
  return x;
}

class LlamaFiles final : public ModelFileAdapter {
 public:
  explicit LlamaFiles(HfLlamaFamily family) : family_(std::move(family)) {}
  std::string model_name() const override { return family_.model_name; }

  std::vector<ForeignTensor> hf_tensors(const Parameter& p, const ModelDims& d) const override {
    const Shape& g = p.shard.global;
    if (p.name == kTokenTable || p.name == kHead) {
      const std::vector<std::string> names =
          p.name == kHead ? std::vector<std::string>{p.name} : std::vector<std::string>{kHfPrefix + p.name, p.name};
      return {ForeignTensor{names, {d.vocab_size, g[1]}, ForeignLayout::RealRows, d.vocab_size}};
    }
    // A fused projection: one tensor per row block, `rows` each, named by `parts`.
    auto split = [&](const std::string& fused, const std::vector<std::pair<std::string, int64_t>>& parts) {
      std::vector<ForeignTensor> out;
      int64_t row = 0;
      for (const auto& [part, rows] : parts) {
        const std::string n = renamed(p.name, fused, part);
        out.push_back(ForeignTensor{{kHfPrefix + n, n}, {rows, g[1]}, ForeignLayout::Same, 0, row, row + rows});
        row += rows;
      }
      XR_CHECK(row == g[0], p.name, ": parts of ", row, " rows for ", g.str());
      return out;
    };
    const int64_t D = d.head_size(), F = llama_ffn_hidden(d);
    if (ends_with(p.name, ".self_attn.qkv_proj.weight"))
      return split("qkv_proj", {{"q_proj", d.n_head * D}, {"k_proj", d.kv_heads() * D}, {"v_proj", d.kv_heads() * D}});
    if (ends_with(p.name, ".mlp.gate_up_proj.weight")) return split("gate_up_proj", {{"gate_proj", F}, {"up_proj", F}});
    return {ForeignTensor{{kHfPrefix + p.name, p.name}, g, ForeignLayout::Same, 0}};
  }

  ExtraTensor hf_extra(const std::string& stored) const override {
    // Untied, lm_head.weight is a parameter and never reaches here; tied, a
    // copy in the file must be the token table's.
    if (stored == kHead) return {ExtraTensor::Kind::TiedCopy, kTokenTable, "the token table"};
    const bool prefixed = stored.rfind(kHfPrefix, 0) == 0;
    if (is_rotary_buffer(prefixed ? stored.substr(sizeof kHfPrefix - 1) : stored))
      return {ExtraTensor::Kind::Ignored, "", ""};
    return {};
  }

  std::string hf_config_json(const ModelDims& d, DType dtype) const override;
  std::string hf_config_problem(const std::string& config_json, const ModelDims& d) const override;

  std::string llmc_header_problem(const LlmcHeader&, const ModelDims& d) const override {
    return str_cat("llm.c model files hold GPT-2 only; model.arch=", d.arch,
                   " is imported from Hugging Face safetensors instead");
  }
  std::vector<LlmcTensor> llmc_tensors(const LlmcHeader&, const std::vector<Parameter>&,
                                       const ModelDims&) const override {
    fail(ErrorKind::Data, "llm.c model files hold GPT-2 only; ", family_.model_name, " has no llm.c layout");
  }

 private:
  HfLlamaFamily family_;
};

std::string LlamaFiles::hf_config_json(const ModelDims& d, DType dtype) const {
  const char* torch_dtype = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  nlohmann::json rope_scaling = nullptr;
  if (d.rope.scaling.type == RopeScaling::Type::Llama3) {
    const RopeScaling& s = d.rope.scaling;
    rope_scaling = {{"rope_type", "llama3"},
                    {"factor", number(s.factor)},
                    {"low_freq_factor", number(s.low_freq_factor)},
                    {"high_freq_factor", number(s.high_freq_factor)},
                    {"original_max_position_embeddings", number(s.original_max_position_embeddings)}};
  }
  nlohmann::json config = {{"architectures", {family_.architecture}},
                                 {"model_type", family_.model_type},
                                 {"hidden_size", d.d_model},
                                 {"intermediate_size", llama_ffn_hidden(d)},
                                 {"num_attention_heads", d.n_head},
                                 {"num_key_value_heads", d.kv_heads()},
                                 {"num_hidden_layers", d.n_layer},
                                 {"head_dim", d.head_size()},
                                 {"vocab_size", d.vocab_size},
                                 {"max_position_embeddings", d.max_seq_len},
                                 {"rms_norm_eps", d.norm_eps},
                                 {"rope_theta", number(d.rope.theta)},
                                 {"rope_scaling", rope_scaling},
                                 {"tie_word_embeddings", d.tie_embeddings.value_or(false)},
                                 {"hidden_act", "silu"},
                                 {"attention_dropout", 0.0},
                                 {"initializer_range", 0.02},
                                 {"torch_dtype", torch_dtype}};
  for (const HfLlamaFamily::Off& o : family_.off) config[o.field] = false;
  return config.dump(2) + "\n";
}

std::string LlamaFiles::hf_config_problem(const std::string& text, const ModelDims& d) const {
  const HfConfigCheck c(text);
  if (!c.problem().empty()) return c.problem();
  const int64_t F = llama_ffn_hidden(d);
  const std::string ffn_key = d.ffn_hidden > 0 ? "model.ffn_hidden"
                                               : str_cat("model.ffn_multiple_of=", d.ffn_multiple_of,
                                                         " and ffn_dim_multiplier=", d.ffn_dim_multiplier,
                                                         ", an MLP width");
  const bool tied = d.tie_embeddings.value_or(false);
  // Absent fields take LlamaConfig's defaults where the tensors would not
  // show a difference (rms_norm_eps, rope_theta, tie_word_embeddings).
  // max_position_embeddings is not compared: no tensor depends on it, and
  // model.seq_len may well be shorter than the context a model was made for.
  for (const std::string& p :
       {c.model(family_.architecture, family_.model_type, d.arch), c.integer("hidden_size", d.d_model, "model.d_model"),
        c.integer("intermediate_size", F, ffn_key), c.integer("num_hidden_layers", d.n_layer, "model.n_layer"),
        c.integer("num_attention_heads", d.n_head, "model.n_head"),
        c.integer("num_key_value_heads", d.kv_heads(), "model.n_kv_head"),
        c.integer("head_dim", d.head_size(), d.head_dim > 0 ? "model.head_dim" : "model.d_model / model.n_head"),
        c.integer("vocab_size", d.vocab_size, "model.vocab_size"),
        c.number("rms_norm_eps", d.norm_eps, "model.norm_eps", 1e-6),
        c.number("rope_theta", d.rope.theta, "model.rope_theta", 10000.0),
        c.boolean("tie_word_embeddings", tied, "model.tie_embeddings", false),
        c.text("hidden_act", "silu", str_cat("model.arch=", d.arch, " computes SwiGLU (\"silu\")"))})
    if (!p.empty()) return p;
  for (const HfLlamaFamily::Off& o : family_.off) {
    const auto v = c.json().find(o.field);
    if (v != c.json().end() && *v != false)
      return str_cat(o.field, " is ", v->dump(), "; model.arch=", d.arch, " has ", o.instead);
  }

  // rope_scaling: null (absent, or rope_type "default") or Llama 3.1's.
  const bool ours = d.rope.scaling.type == RopeScaling::Type::Llama3;
  const auto rs = c.json().find("rope_scaling");
  std::string type = "none";
  if (rs != c.json().end() && !rs->is_null()) {
    if (!rs->is_object()) return str_cat("rope_scaling is ", rs->dump(), "; expected null or an object");
    const auto t = rs->contains("rope_type") ? rs->find("rope_type") : rs->find("type");
    if (t == rs->end() || !t->is_string())
      return str_cat("rope_scaling is ", rs->dump(), ", without a rope_type");
    type = t->get<std::string>() == "default" ? "none" : t->get<std::string>();
    if (type != "none" && type != "llama3")
      return str_cat("rope_scaling has rope_type \"", type, "\"; model.rope_scaling.type is none or llama3");
  }
  if ((type == "llama3") != ours)
    return str_cat("rope_scaling has rope_type ", type, " but the config has model.rope_scaling.type=",
                   ours ? "llama3" : "none");
  if (!ours) return "";
  const HfConfigCheck r(rs->dump());
  const RopeScaling& s = d.rope.scaling;
  for (const std::string& p :
       {r.number("factor", s.factor, "model.rope_scaling.factor"),
        r.number("low_freq_factor", s.low_freq_factor, "model.rope_scaling.low_freq_factor"),
        r.number("high_freq_factor", s.high_freq_factor, "model.rope_scaling.high_freq_factor"),
        r.number("original_max_position_embeddings", s.original_max_position_embeddings,
                 "model.rope_scaling.original_max_position_embeddings")})
    if (!p.empty()) return "rope_scaling." + p;
  return "";
}

}  // namespace

const ModelFileAdapter& llama_file_adapter() {
  static const LlamaFiles adapter({.model_name = "LLaMA",
                                   .architecture = "LlamaForCausalLM",
                                   .model_type = "llama",
                                   .off = {{"attention_bias", "bias-free projections"},
                                           {"mlp_bias", "bias-free projections"}}});
  return adapter;
}

std::unique_ptr<ModelFileAdapter> make_llama_family_files(HfLlamaFamily family) {
  return std::make_unique<LlamaFiles>(std::move(family));
}

}  // namespace xirang
