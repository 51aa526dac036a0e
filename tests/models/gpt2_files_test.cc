// GPT-2's file adapter (models/gpt2/gpt2_files.h) and the layout
// conversions every adapter shares (models/file_adapter.h), without files:
// the names, shapes and layouts Hugging Face and llm.c use, the llm.c
// header rules, and the registry's lookup.
#include "models/gpt2/gpt2_files.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>

#include "models/gpt2/gpt2.h"
#include "tests/support/expect_error.h"

namespace xirang {
namespace {

const ModelDims kDims{.n_layer = 2, .n_head = 4, .d_model = 8, .max_seq_len = 16, .vocab_size = 250};

std::vector<Parameter> one_rank() { return gpt2_parameters(kDims, ChunkPlacement::whole(kDims.n_layer), 1, 0); }

const Parameter& param(const std::vector<Parameter>& ps, const std::string& name) {
  for (const Parameter& p : ps)
    if (p.name == name) return p;
  throw std::runtime_error("no parameter " + name);
}

LlmcHeader header_of(const ModelDims& d, int padded_vocab) {
  LlmcHeader h{};
  h[0] = 20240326;
  h[1] = 3;
  h[2] = d.max_seq_len;
  h[3] = d.vocab_size;
  h[4] = d.n_layer;
  h[5] = d.n_head;
  h[6] = d.d_model;
  h[7] = padded_vocab;
  return h;
}

TEST(Gpt2Files, RegisteredForGpt2) {
  EXPECT_EQ(model_arch("gpt2").files, &gpt2_file_adapter());
  EXPECT_EQ(&file_adapter(model_arch("gpt2")), &gpt2_file_adapter());
}

TEST(Gpt2Files, AnArchitectureWithoutAnAdapterIsAConfigErrorNamingIt) {
  ModelArch bare;
  bare.name = "toy";
  expect_error([&] { file_adapter(bare); }, ErrorKind::Config, {"model.arch=toy", "no adapter"});
}

TEST(Gpt2Files, HuggingFaceNamesShapesAndLayouts) {
  const ModelFileAdapter& a = gpt2_file_adapter();
  const std::vector<Parameter> ps = one_rank();
  const int64_t C = kDims.d_model, V = kDims.vocab_size, Vp = kDims.padded_vocab();
  std::set<std::string> names;
  for (const Parameter& p : ps) {
    const std::vector<ForeignTensor> parts = a.hf_tensors(p, kDims);
    ASSERT_EQ(parts.size(), 1u) << p.name << ": GPT-2 stores every parameter whole";
    const ForeignTensor& t = parts[0];
    EXPECT_EQ(t.row_begin, 0) << p.name;
    EXPECT_EQ(t.row_end, -1) << p.name;
    ASSERT_EQ(t.names.size(), 2u) << p.name;
    EXPECT_EQ(t.names[0], "transformer." + p.name);
    EXPECT_EQ(t.names[1], p.name);
    EXPECT_TRUE(names.insert(t.names[0]).second) << t.names[0];
    EXPECT_EQ(t.shape.numel(), p.name == "wte.weight" ? V * C : p.shard.global.numel()) << p.name;
  }
  const ForeignTensor wte = a.hf_tensors(param(ps, "wte.weight"), kDims).at(0);
  EXPECT_EQ(wte.layout, ForeignLayout::RealRows);
  EXPECT_EQ(wte.shape, (Shape{V, C}));
  EXPECT_EQ(wte.real_rows, V);
  EXPECT_TRUE(foreign_accepts(wte, Shape{Vp, C}, Shape{Vp, C})) << "a padded table is accepted too";
  EXPECT_FALSE(foreign_accepts(wte, Shape{Vp, C}, Shape{V + 1, C}));
  for (const char* conv1d : {"h.1.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.1.mlp.c_fc.weight",
                             "h.0.mlp.c_proj.weight"}) {
    const Parameter& p = param(ps, conv1d);
    const ForeignTensor t = a.hf_tensors(p, kDims).at(0);
    EXPECT_EQ(t.layout, ForeignLayout::Transposed) << conv1d;
    EXPECT_EQ(t.shape, (Shape{p.shard.global[1], p.shard.global[0]})) << conv1d;
  }
  for (const char* same : {"wpe.weight", "h.0.ln_1.weight", "h.1.attn.c_attn.bias", "h.0.mlp.c_proj.bias",
                           "ln_f.bias"})
    EXPECT_EQ(a.hf_tensors(param(ps, same), kDims).at(0).layout, ForeignLayout::Same) << same;
}

TEST(Gpt2Files, HuggingFaceExtraTensors) {
  const ModelFileAdapter& a = gpt2_file_adapter();
  for (const char* head : {"lm_head.weight", "transformer.lm_head.weight"}) {
    const ExtraTensor x = a.hf_extra(head);
    EXPECT_EQ(x.kind, ExtraTensor::Kind::TiedCopy) << head;
    EXPECT_EQ(x.param, "wte.weight");
  }
  for (const char* mask : {"h.0.attn.bias", "transformer.h.11.attn.masked_bias"})
    EXPECT_EQ(a.hf_extra(mask).kind, ExtraTensor::Kind::Ignored) << mask;
  for (const char* other : {"h.attn.bias", "h.0.attn.c_attn.bias2", "transformer.h.0.mlp.bias", "score.weight"})
    EXPECT_EQ(a.hf_extra(other).kind, ExtraTensor::Kind::Unknown) << other;
}

TEST(Gpt2Files, ConfigJson) {
  const nlohmann::json c = nlohmann::json::parse(gpt2_file_adapter().hf_config_json(kDims, DType::BF16));
  EXPECT_EQ(c["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(c["model_type"], "gpt2");
  EXPECT_EQ(c["n_embd"], kDims.d_model);
  EXPECT_EQ(c["n_layer"], kDims.n_layer);
  EXPECT_EQ(c["n_head"], kDims.n_head);
  EXPECT_EQ(c["n_positions"], kDims.max_seq_len);
  EXPECT_EQ(c["vocab_size"], kDims.vocab_size);
  EXPECT_EQ(c["tie_word_embeddings"], true);
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
}

TEST(Gpt2Files, ConfigJsonIsCheckedAgainstTheConfig) {
  const ModelFileAdapter& a = gpt2_file_adapter();
  const std::string ours = a.hf_config_json(kDims, DType::F32);
  EXPECT_EQ(a.hf_config_problem(ours, kDims), "");
  EXPECT_EQ(a.hf_config_problem("{}", kDims), "") << "every field may be absent";
  auto with = [&](const char* field, nlohmann::json value) {
    nlohmann::json j = nlohmann::json::parse(ours);
    j[field] = value;
    return a.hf_config_problem(j.dump(), kDims);
  };
  EXPECT_EQ(with("n_layer", 3), "n_layer is 3 but the config has model.n_layer=2");
  EXPECT_EQ(with("n_embd", 16), "n_embd is 16 but the config has model.d_model=8");
  EXPECT_EQ(with("n_positions", 1024), "n_positions is 1024 but the config has model.seq_len=16");
  EXPECT_EQ(with("tie_word_embeddings", false),
            "tie_word_embeddings is false but the config has model.tie_embeddings=true");
  EXPECT_EQ(with("architectures", {"LlamaForCausalLM"}),
            "architectures is [\"LlamaForCausalLM\"], a model other than the config's: model.arch=gpt2 reads "
            "GPT2LMHeadModel");
  EXPECT_EQ(with("model_type", "llama"),
            "model_type is \"llama\", a model other than the config's: model.arch=gpt2 reads \"gpt2\"");
  EXPECT_EQ(a.hf_config_problem("[1, 2]", kDims), "it is not a JSON object");
  EXPECT_EQ(a.hf_config_problem("{not json", kDims), "it is not a JSON object");
}

TEST(Gpt2Files, LlmcHeaderIsCheckedAgainstTheConfig) {
  const ModelFileAdapter& a = gpt2_file_adapter();
  EXPECT_EQ(a.llmc_header_problem(header_of(kDims, 256), kDims), "");
  EXPECT_EQ(a.llmc_header_problem(header_of(kDims, 250), kDims), "") << "no padding at all is fine";
  ModelDims other = kDims;
  other.n_layer = 3;
  EXPECT_EQ(a.llmc_header_problem(header_of(other, 256), kDims),
            "the llm.c header has n_layer 3 but the config has model.n_layer=2");
  other = kDims;
  other.max_seq_len = 1024;
  EXPECT_NE(a.llmc_header_problem(header_of(other, 256), kDims).find("max_seq_len 1024"), std::string::npos);
  EXPECT_NE(a.llmc_header_problem(header_of(kDims, 249), kDims).find("padded_vocab_size 249 < vocab_size 250"),
            std::string::npos);
}

TEST(Gpt2Files, LlmcOrderFillsEveryParameterOnce) {
  const std::vector<Parameter> ps = one_rank();
  const std::vector<LlmcTensor> order = gpt2_file_adapter().llmc_tensors(header_of(kDims, 320), ps, kDims);
  ASSERT_EQ(order.size(), ps.size());
  std::set<size_t> seen;
  for (const LlmcTensor& t : order) EXPECT_TRUE(seen.insert(t.param).second) << ps[t.param].name;
  // wte with the file's own padding, wpe, then each block tensor for all layers, then ln_f.
  EXPECT_EQ(ps[order[0].param].name, "wte.weight");
  EXPECT_EQ(order[0].stored.shape, (Shape{320, kDims.d_model}));
  EXPECT_EQ(order[0].stored.layout, ForeignLayout::RealRows);
  EXPECT_EQ(order[0].stored.real_rows, kDims.vocab_size);
  EXPECT_EQ(ps[order[1].param].name, "wpe.weight");
  EXPECT_EQ(ps[order[2].param].name, "h.0.ln_1.weight");
  EXPECT_EQ(ps[order[3].param].name, "h.1.ln_1.weight");
  EXPECT_EQ(ps[order[4].param].name, "h.0.ln_1.bias");
  EXPECT_EQ(ps[order.back().param].name, "ln_f.bias");
  for (size_t k = 1; k < order.size(); ++k) {
    EXPECT_EQ(order[k].stored.layout, ForeignLayout::Same);
    EXPECT_EQ(order[k].stored.shape, ps[order[k].param].shard.global);
  }
}

TEST(FileAdapter, LayoutConversionsRoundTrip) {
  const Shape ours{3, 2};
  const std::vector<float> v{1, 2, 3, 4, 5, 6};
  const ForeignTensor t{{}, {2, 3}, ForeignLayout::Transposed, 0};
  const std::vector<float> stored = to_foreign(t, ours, v);
  EXPECT_EQ(stored, (std::vector<float>{1, 3, 5, 2, 4, 6}));
  std::vector<float> back(6, 0.0f);
  from_foreign(t, t.shape, stored, ours, back);
  EXPECT_EQ(back, v);

  const ForeignTensor rows{{}, {2, 2}, ForeignLayout::RealRows, 2};
  EXPECT_EQ(to_foreign(rows, ours, v), (std::vector<float>{1, 2, 3, 4})) << "padding rows are not stored";
  std::vector<float> padded(6, 0.0f);
  from_foreign(rows, Shape{4, 2}, {1, 2, 3, 4, 9, 9, 9, 9}, ours, padded);
  EXPECT_EQ(padded, (std::vector<float>{1, 2, 3, 4, 0, 0})) << "the file's padding is dropped, ours is zero";

  const ForeignTensor same{{}, ours, ForeignLayout::Same, 0};
  EXPECT_EQ(to_foreign(same, ours, v), v);
}

TEST(FileAdapter, RowBlocksCoverAFusedParameter) {
  // Ours (5, 2): rows 0-1 one stored tensor, rows 2-4 another, transposed.
  const Shape ours{5, 2};
  const std::vector<float> v{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const ForeignTensor top{{}, {2, 2}, ForeignLayout::Same, 0, 0, 2};
  const ForeignTensor rest{{}, {2, 3}, ForeignLayout::Transposed, 0, 2, 5};
  EXPECT_EQ(foreign_block(top, ours), (Shape{2, 2}));
  EXPECT_EQ(foreign_block(rest, ours), (Shape{3, 2}));
  EXPECT_EQ(to_foreign(top, ours, v), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(to_foreign(rest, ours, v), (std::vector<float>{5, 7, 9, 6, 8, 10}));
  std::vector<float> back(10, 0.0f);
  from_foreign(rest, rest.shape, {5, 7, 9, 6, 8, 10}, ours, back);
  EXPECT_EQ(back, (std::vector<float>{0, 0, 0, 0, 5, 6, 7, 8, 9, 10})) << "only the block's rows are written";
  from_foreign(top, top.shape, {1, 2, 3, 4}, ours, back);
  EXPECT_EQ(back, v);
  EXPECT_TRUE(foreign_accepts(rest, ours, Shape{2, 3}));
  EXPECT_FALSE(foreign_accepts(rest, ours, Shape{3, 2}));
  // A padded block of rows (a vocabulary in a fused table): the real rows only.
  const ForeignTensor rows{{}, {1, 2}, ForeignLayout::RealRows, 1, 3, 5};
  EXPECT_EQ(to_foreign(rows, ours, v), (std::vector<float>{7, 8}));
  EXPECT_TRUE(foreign_accepts(rows, ours, Shape{2, 2})) << "the block's padded shape";
  const ForeignTensor bad{{}, {2, 2}, ForeignLayout::Same, 0, 4, 6};
  expect_error([&] { foreign_block(bad, ours); }, ErrorKind::Internal, {"rows [4, 6)", "(5, 2)"});
}

}  // namespace
}  // namespace xirang
