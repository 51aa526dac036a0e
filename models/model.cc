#include "models/model.h"

#include "core/error.h"
#include "models/gpt2/gpt2.h"
#include "models/llama/llama.h"
#include "models/qwen3/qwen3.h"

namespace xirang {

namespace {

// The registry: one entry per architecture, in the order they are listed.
const std::vector<ModelArch>& registry() {
  static const std::vector<ModelArch> archs = {gpt2_arch(), llama_arch(), qwen3_arch()};
  return archs;
}

}  // namespace

const ModelArch& model_arch(const std::string& name) {
  for (const ModelArch& a : registry())
    if (a.name == name) return a;
  fail(ErrorKind::Config, "model.arch='", name, "' is not supported (supported: ", model_arch_names(), ")");
}

bool model_arch_known(const std::string& name) {
  for (const ModelArch& a : registry())
    if (a.name == name) return true;
  return false;
}

std::string model_arch_names() {
  std::string names;
  for (const ModelArch& a : registry()) names += (names.empty() ? "" : ", ") + a.name;
  return names;
}

const ModelPreset& find_model_preset(const std::string& name) {
  for (const ModelArch& a : registry())
    for (const ModelPreset& p : a.presets)
      if (p.name == name) return p;
  fail(ErrorKind::Config, "model.preset='", name, "' is not a preset (presets: ", model_preset_names(), ")");
}

std::string model_preset_names() {
  std::string names;
  for (const ModelArch& a : registry())
    for (const ModelPreset& p : a.presets) names += (names.empty() ? "" : ", ") + p.name;
  return names;
}

std::string layout_problem(const ModelDims& m, const ParallelLayout& l) {
  if (m.n_layer < 1 || m.n_head < 1 || m.d_model < 1 || m.max_seq_len < 1 || m.vocab_size < 1 || m.vocab_multiple < 1)
    return "model.n_layer, n_head, d_model, seq_len, vocab_size and vocab_multiple must be >= 1";
  if (m.head_dim < 0) return str_cat("model.head_dim=", m.head_dim, " must be >= 0 (0 means d_model / n_head)");
  if (m.head_dim == 0 && m.d_model % m.n_head != 0)
    return str_cat("model.d_model=", m.d_model, " is not divisible by model.n_head=", m.n_head,
                   " (or set model.head_dim)");
  if (m.n_kv_head < 0 || m.n_head % m.kv_heads() != 0)
    return str_cat("model.n_kv_head=", m.n_kv_head, " does not divide model.n_head=", m.n_head,
                   " (query heads share key/value heads in equal groups; 0 means n_head)");
  if (l.dp < 1 || l.tp < 1 || l.pp < 1 || l.virtual_stages < 1)
    return "parallel.dp, tp, pp and virtual_stages must be >= 1";
  if (l.virtual_stages > 1 && l.pp == 1)
    return str_cat("parallel.virtual_stages=", l.virtual_stages, " needs parallel.pp > 1 (virtual stages interleave ",
                   "pipeline ranks)");
  // Stages own whole layers, split evenly.
  if (m.n_layer % (int64_t{l.pp} * l.virtual_stages) != 0)
    return str_cat("model.n_layer=", m.n_layer, " is not divisible by parallel.pp (", l.pp,
                   ") x parallel.virtual_stages (", l.virtual_stages, "): pipeline stages hold equal whole layers");
  return model_arch(m.arch).layout_problem(m, l);
}

void check_layout(const ModelDims& dims, const ParallelLayout& layout) {
  const std::string problem = layout_problem(dims, layout);
  if (!problem.empty()) fail(ErrorKind::Config, problem);
}

// ---- ModelChunk

ModelChunk::ModelChunk(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch)
    : dims_(dims),
      placement_(placement),
      dtype_(dtype),
      wide_dtype_(dtype == DType::BF16 || dtype == DType::F16 ? DType::F32 : dtype),
      batch_(batch) {
  XR_CHECK(is_float(dtype), "model dtype ", dtype_name(dtype), " is not a float type");
  XR_CHECK(0 <= placement.first_layer && placement.first_layer <= placement.end_layer &&
               placement.end_layer <= dims.n_layer,
           "chunk layers [", placement.first_layer, ", ", placement.end_layer, ") of ", dims.n_layer);
}

void ModelChunk::layout_parameters(Arena& params, Arena& grads) {
  if (wide_dtype_ == dtype_) {
    for (auto& p : params_) {
      p.value = params.alloc(p.value.shape(), dtype_, p.name);
      p.grad = grads.alloc(p.grad.shape(), wide_dtype_, p.name + " (grad)");
    }
    return;
  }
  // Both arenas advance by the same number of elements per parameter.
  const int64_t block = int64_t(Arena::kAlignment / dtype_size(dtype_));
  for (auto& p : params_) {
    const Shape shape = p.value.shape();
    const int64_t padded = (shape.numel() + block - 1) / block * block;
    p.value = params.alloc({padded}, dtype_, p.name).flat_range(0, shape.numel()).view(shape);
    p.grad = grads.alloc({padded}, wide_dtype_, p.name + " (grad)").flat_range(0, shape.numel()).view(shape);
  }
}

void ModelChunk::init_parameters(uint64_t seed) {
  for (const Parameter& p : params_) init_parameter(p, seed);
}

std::vector<Parameter*> ModelChunk::tied_parameters() {
  std::vector<Parameter*> tied;
  for (Parameter& p : params_)
    if (p.tied) tied.push_back(&p);
  return tied;
}

int64_t ModelChunk::num_parameters() const {
  int64_t n = 0;
  for (auto& p : params_) n += p.value.numel();
  return n;
}

int64_t ModelChunk::num_global_parameters() const {
  int64_t n = 0;
  for (auto& p : params_) n += p.shard.global.numel();
  return n;
}

}  // namespace xirang
