// GPT-2 in Hugging Face and llm.c model files (models/gpt2/gpt2_files.h).
#include "models/gpt2/gpt2_files.h"

#include <cctype>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/layernorm.h"  // kLayerNormEps, for config.json
#include "models/model.h"

namespace xirang {

namespace {

constexpr char kHfPrefix[] = "transformer.";  // GPT2LMHeadModel's GPT2Model
constexpr char kTokenTable[] = "wte.weight";

// Conv1D keeps the block matrices (attn.c_attn, attn.c_proj, mlp.c_fc,
// mlp.c_proj weights) as (in, out): ours transposed.
bool conv1d(const Parameter& p) { return p.layer >= 0 && p.shard.global.rank() == 2; }

// Hugging Face's causal-mask buffers: h.<l>.attn.bias and h.<l>.attn.masked_bias.
bool is_attention_buffer(const std::string& name) {
  if (name.rfind("h.", 0) != 0) return false;
  size_t i = 2;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  if (i == 2 || i >= name.size() || name[i] != '.') return false;
  const std::string rest = name.substr(i + 1);
  return rest == "attn.bias" || rest == "attn.masked_bias";
}

size_t find_param(const std::vector<Parameter>& params, const std::string& name) {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].name == name) return i;
  fail(ErrorKind::Internal, "llm.c tensor order names '", name, "', which the model lacks");
}

class Gpt2Files final : public ModelFileAdapter {
 public:
  std::string model_name() const override { return "GPT-2"; }

  std::vector<ForeignTensor> hf_tensors(const Parameter& p, const ModelDims& d) const override {
    const Shape& g = p.shard.global;
    ForeignTensor t{{kHfPrefix + p.name, p.name}, g, ForeignLayout::Same, 0};
    if (p.name == kTokenTable) {
      t.shape = {d.vocab_size, g[1]};
      t.layout = ForeignLayout::RealRows;
      t.real_rows = d.vocab_size;
    } else if (conv1d(p)) {
      t.shape = {g[1], g[0]};
      t.layout = ForeignLayout::Transposed;
    }
    return {t};
  }

  ExtraTensor hf_extra(const std::string& stored) const override {
    const bool prefixed = stored.rfind(kHfPrefix, 0) == 0;
    const std::string name = prefixed ? stored.substr(sizeof kHfPrefix - 1) : stored;
    // Tied, as GPT-2 is: the head is the token table, kept once.
    if (name == "lm_head.weight") return {ExtraTensor::Kind::TiedCopy, kTokenTable, "the token table"};
    if (is_attention_buffer(name)) return {ExtraTensor::Kind::Ignored, "", ""};
    return {};
  }

  std::string hf_config_json(const ModelDims& d, DType dtype) const override;
  std::string hf_config_problem(const std::string& config_json, const ModelDims& d) const override;
  std::string llmc_header_problem(const LlmcHeader& h, const ModelDims& d) const override;
  std::vector<LlmcTensor> llmc_tensors(const LlmcHeader& h, const std::vector<Parameter>& params,
                                       const ModelDims& d) const override;
};

std::string Gpt2Files::hf_config_json(const ModelDims& d, DType dtype) const {
  const char* torch_dtype = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  const nlohmann::json config = {{"architectures", {"GPT2LMHeadModel"}},
                                 {"model_type", "gpt2"},
                                 {"n_embd", d.d_model},
                                 {"n_layer", d.n_layer},
                                 {"n_head", d.n_head},
                                 {"n_positions", d.max_seq_len},
                                 {"n_ctx", d.max_seq_len},
                                 {"vocab_size", d.vocab_size},
                                 {"activation_function", "gelu_new"},  // the tanh GELU
                                 {"layer_norm_epsilon", kLayerNormEps},
                                 {"tie_word_embeddings", true},
                                 {"torch_dtype", torch_dtype}};
  return config.dump(2) + "\n";
}

std::string Gpt2Files::hf_config_problem(const std::string& text, const ModelDims& d) const {
  const HfConfigCheck c(text);
  if (!c.problem().empty()) return c.problem();
  // The fields that shape tensors; tie_word_embeddings defaults to true in GPT2Config.
  for (const std::string& p :
       {c.model("GPT2LMHeadModel", "gpt2", d.arch), c.integer("n_embd", d.d_model, "model.d_model"),
        c.integer("n_layer", d.n_layer, "model.n_layer"), c.integer("n_head", d.n_head, "model.n_head"),
        c.integer("n_positions", d.max_seq_len, "model.seq_len"),
        c.integer("vocab_size", d.vocab_size, "model.vocab_size"),
        c.boolean("tie_word_embeddings", true, "model.tie_embeddings", true)})
    if (!p.empty()) return p;
  return "";
}

std::string Gpt2Files::llmc_header_problem(const LlmcHeader& h, const ModelDims& d) const {
  struct Field {
    int at;
    const char *header, *key;
    int config;
  };
  for (const Field& x : {Field{2, "max_seq_len", "model.seq_len", d.max_seq_len},
                         Field{3, "vocab_size", "model.vocab_size", d.vocab_size},
                         Field{4, "n_layer", "model.n_layer", d.n_layer}, Field{5, "n_head", "model.n_head", d.n_head},
                         Field{6, "channels", "model.d_model", d.d_model}})
    if (h[size_t(x.at)] != x.config)
      return str_cat("the llm.c header has ", x.header, " ", h[size_t(x.at)], " but the config has ", x.key, "=",
                     x.config);
  if (h[7] < d.vocab_size)
    return str_cat("the llm.c header has padded_vocab_size ", h[7], " < vocab_size ", d.vocab_size);
  return "";
}

std::vector<LlmcTensor> Gpt2Files::llmc_tensors(const LlmcHeader& h, const std::vector<Parameter>& params,
                                                const ModelDims& d) const {
  // wte with the file's padded rows (llm.c's padding need not be ours), wpe,
  // then each block tensor for all layers at once, then ln_f.
  std::vector<LlmcTensor> out;
  auto add = [&](const std::string& name) {
    const size_t i = find_param(params, name);
    out.push_back({i, ForeignTensor{{}, params[i].shard.global, ForeignLayout::Same, 0}});
  };
  add(kTokenTable);
  out.back().stored = ForeignTensor{{}, {h[7], d.d_model}, ForeignLayout::RealRows, d.vocab_size};
  add("wpe.weight");
  static constexpr const char* kBlockTensors[] = {
      "ln_1.weight",        "ln_1.bias",        "attn.c_attn.weight", "attn.c_attn.bias",
      "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
      "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
  for (const char* t : kBlockTensors)
    for (int l = 0; l < d.n_layer; ++l) add(str_cat("h.", l, ".", t));
  add("ln_f.weight");
  add("ln_f.bias");
  return out;
}

}  // namespace

const ModelFileAdapter& gpt2_file_adapter() {
  static const Gpt2Files adapter;
  return adapter;
}

}  // namespace xirang
