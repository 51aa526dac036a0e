// models/file_adapter.h: what an architecture tells the checkpoint converter
// about its foreign model files (Hugging Face safetensors, llm.c).
//
// The converter (runtime/checkpoint/model_files.h) knows the containers: a
// safetensors header and data section, an llm.c header of 256 int32 and
// raw values. It knows no model. An architecture that can be exported or
// imported gives ModelArch::files an adapter, which owns its foreign names,
// the shapes and layouts those files store, the tensors to ignore or to
// check against a tied parameter, the config.json written beside an export,
// and the meaning and order of an llm.c file. Each layout difference is a
// ForeignLayout value, and a parameter we keep fused that a file splits
// (LLaMA's q, k and v) is several ForeignTensors, each holding a block of
// its rows; to_foreign and from_foreign apply both, so converting is the
// same code for every architecture.
//
//   const ModelFileAdapter& files = file_adapter(model_arch(dims.arch));   // a Config error without one
//   for (const Parameter& p : params)
//     for (const ForeignTensor& t : files.hf_tensors(p, dims))            // "transformer.h.0.attn.c_attn.weight", (C, 3C)
//       write(t.names[0], t.shape, to_foreign(t, p.shard.global, values_of(p)));
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "models/parameter.h"

namespace xirang {

struct ModelArch;
struct ModelDims;

// How a stored tensor's elements relate to our parameter's (global shape).
enum class ForeignLayout {
  Same,        // element for element
  Transposed,  // a matrix stored (in, out) where ours is (out, in)
  RealRows,    // ours has padding rows past the first real_rows: not stored on export, zero on import
};

// How one of our parameters, or a block of its rows, is stored in a foreign file.
struct ForeignTensor {
  std::vector<std::string> names;  // names[0] is written on export; an import accepts each (llm.c: none)
  Shape shape;                     // the stored shape
  ForeignLayout layout = ForeignLayout::Same;
  int64_t real_rows = 0;           // RealRows: the rows that hold values (the unpadded vocabulary)
  // The rows of our parameter it holds, [row_begin, row_end); row_end -1:
  // all of them. The layout applies to that block as if it were the whole
  // parameter (LLaMA's k_proj is rows [H D, (H + KV) D) of qkv_proj).
  int64_t row_begin = 0, row_end = -1;
};

// What a stored tensor that is none of our parameters' names is.
struct ExtraTensor {
  enum class Kind {
    Unknown,   // an error: the file holds a model other than the config's
    Ignored,   // a buffer the model rebuilds (an attention mask)
    TiedCopy,  // a second copy of parameter `param` (a head tied to the token table): it must equal it
  };
  Kind kind = Kind::Unknown;
  std::string param;  // TiedCopy: our name of the parameter it copies
  std::string what;   // TiedCopy: that parameter, in messages ("the token table")
};

// An llm.c model file's header, 256 int32: [0] magic and [1] version are
// the container's, the rest belongs to the architecture.
using LlmcHeader = std::array<int32_t, 256>;

// One tensor of an llm.c file, in file order, and the parameter it fills.
struct LlmcTensor {
  size_t param;          // index into the parameter list given to llmc_tensors
  ForeignTensor stored;  // no names; shape as stored
};

class ModelFileAdapter {
 public:
  virtual ~ModelFileAdapter() = default;
  // The model in messages ("GPT-2").
  virtual std::string model_name() const = 0;

  // Hugging Face safetensors: how parameter p of the one-rank list is
  // stored: one tensor, or several whose row blocks, in order, cover it.
  virtual std::vector<ForeignTensor> hf_tensors(const Parameter& p, const ModelDims& dims) const = 0;
  // A stored name that is no name of any hf_tensors.
  virtual ExtraTensor hf_extra(const std::string& stored_name) const = 0;
  // The config.json written beside an export whose tensors are in `dtype`.
  virtual std::string hf_config_json(const ModelDims& dims, DType dtype) const = 0;
  // The config.json found beside an import (its text): "" when it describes
  // the model of `dims`, else the first difference, naming the config.json
  // field, its value, the config key and its value (or the architecture
  // it names instead of this one).
  virtual std::string hf_config_problem(const std::string& config_json, const ModelDims& dims) const = 0;

  // llm.c: "" when the header describes the model of `dims`, else what
  // differs, naming the header field and the config key.
  virtual std::string llmc_header_problem(const LlmcHeader& h, const ModelDims& dims) const = 0;
  // The file's tensors after the header, in order, for a header without a problem.
  virtual std::vector<LlmcTensor> llmc_tensors(const LlmcHeader& h, const std::vector<Parameter>& params,
                                               const ModelDims& dims) const = 0;
};

// A config.json read for hf_config_problem. Each check returns "" or the
// difference in one phrase naming the field, its value, the config key and
// the config's value; a field the file lacks takes the value transformers
// would give it (`absent`), or passes when there is none.
//
//   const HfConfigCheck c(text);
//   for (const std::string& p : {c.problem(), c.model("LlamaForCausalLM", "llama", "llama"),
//                                c.integer("hidden_size", d.d_model, "model.d_model")})
//     if (!p.empty()) return p;
class HfConfigCheck {
 public:
  explicit HfConfigCheck(const std::string& text);
  // "" or why the text is no JSON object.
  const std::string& problem() const { return problem_; }
  // architectures (its first entry) and model_type, when present, are `architecture` and `model_type`.
  std::string model(const std::string& architecture, const std::string& model_type, const std::string& arch) const;
  std::string integer(const char* field, int64_t want, const std::string& key,
                      std::optional<int64_t> absent = std::nullopt) const;
  // Equal to a relative 1e-9: the value went through decimal text.
  std::string number(const char* field, double want, const std::string& key,
                     std::optional<double> absent = std::nullopt) const;
  std::string boolean(const char* field, bool want, const std::string& key, std::optional<bool> absent = std::nullopt) const;
  // A string field, when present, is `want` (what the model supports, in messages: `why`).
  std::string text(const char* field, const std::string& want, const std::string& why) const;
  const nlohmann::json& json() const { return j_; }

 private:
  nlohmann::json j_;
  std::string problem_;
};

// The adapter of `arch`; a Config error naming model.arch when it has none.
const ModelFileAdapter& file_adapter(const ModelArch& arch);

// The shape of the block of a parameter of global shape `ours` that `t` holds.
Shape foreign_block(const ForeignTensor& t, const Shape& ours);
// Whether a tensor stored with shape `stored` can fill a parameter of
// global shape `ours` stored as `t`: t.shape, or for RealRows also the
// block's own (padded) shape.
bool foreign_accepts(const ForeignTensor& t, const Shape& ours, const Shape& stored);
// A parameter's global values (shape `ours`) as `t` stores them (its block only).
std::vector<float> to_foreign(const ForeignTensor& t, const Shape& ours, std::vector<float> values);
// Stored values (shape `stored`) into t's block of `ours`, a zero-filled
// global tensor of shape `ours_shape`; the rest of `ours` is left as it is.
void from_foreign(const ForeignTensor& t, const Shape& stored, std::vector<float> values, const Shape& ours_shape,
                  std::vector<float>& ours);

}  // namespace xirang
