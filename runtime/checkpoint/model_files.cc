// Hugging Face safetensors and llm.c model files (runtime/checkpoint/model_files.h).
#include "runtime/checkpoint/model_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kernels/layernorm.h"  // kLayerNormEps, for config.json
#include "runtime/config/model_layout.h"

namespace xirang {

// Both formats are little-endian and are read and written with plain copies.
static_assert(std::endian::native == std::endian::little, "model file I/O assumes a little-endian host");

namespace {

// A file read at explicit offsets; a read past its end is a Data error
// that calls the file truncated and says what was being read.
class InFile {
 public:
  explicit InFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail(ErrorKind::Data, "cannot open '", path_, "': ", std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0) fail(ErrorKind::Data, "cannot stat '", path_, "': ", std::strerror(errno));
    size_ = uint64_t(st.st_size);
  }
  ~InFile() { ::close(fd_); }
  InFile(const InFile&) = delete;
  InFile& operator=(const InFile&) = delete;
  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  void read(uint64_t offset, void* dst, uint64_t n, const std::string& what) const {
    if (offset + n > size_)
      fail(ErrorKind::Data, "'", path_, "' is truncated: ", what, " needs bytes [", offset, ", ", offset + n,
           ") but the file has ", size_);
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, off_t(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) fail(ErrorKind::Data, "reading '", path_, "' failed: ", got < 0 ? std::strerror(errno) : "end of file");
      p += got;
      offset += uint64_t(got);
      n -= uint64_t(got);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Written as PATH.tmp, synced and renamed over PATH by commit(); removed
// when commit() is never reached, so PATH is complete or absent.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(ErrorKind::Data, "cannot create '", tmp_, "': ", std::strerror(errno));
  }
  ~AtomicFile() {
    if (fd_ < 0) return;
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t put = ::write(fd_, p, n);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) fail(ErrorKind::Data, "writing '", tmp_, "' failed: ", std::strerror(errno));
      p += put;
      n -= size_t(put);
    }
  }
  void commit() {
    if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
      const int err = errno;
      fd_ = -1;
      ::unlink(tmp_.c_str());
      fail(ErrorKind::Data, "writing '", tmp_, "' failed: ", std::strerror(err));
    }
    fd_ = -1;
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      fail(ErrorKind::Data, "cannot rename '", tmp_, "' to '", path_, "': ", std::strerror(err));
    }
    const size_t slash = path_.find_last_of('/');
    sync_directory(slash == std::string::npos ? "." : path_.substr(0, slash + 1));
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

constexpr char kHfPrefix[] = "transformer.";
constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;  // safetensors' own limit
constexpr uint64_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

// Conv1D keeps the block matrices as (in, out): ours transposed.
bool hf_transposed(const Parameter& p) { return p.layer >= 0 && p.shard.global.rank() == 2; }

// The shape Hugging Face stores parameter p in.
Shape hf_shape(const Parameter& p, const ModelDims& s) {
  const Shape& g = p.shard.global;
  if (p.name == "wte.weight") return {s.vocab_size, g[1]};
  if (hf_transposed(p)) return {g[1], g[0]};
  return g;
}

// (rows, cols) row-major -> (cols, rows).
std::vector<float> transposed(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

const char* st_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    default: fail(ErrorKind::Internal, "no safetensors dtype for ", dtype_name(t));
  }
}

std::optional<DType> st_dtype(const std::string& s) {
  for (DType t : {DType::F32, DType::F64, DType::BF16, DType::F16})
    if (s == st_dtype_name(t)) return t;
  return std::nullopt;
}

// Bytes per element of every safetensors dtype (0: unknown). Files may hold
// integer or boolean buffers (attention masks) that the import ignores.
uint64_t st_element_size(const std::string& s) {
  if (s == "BOOL" || s == "U8" || s == "I8" || s == "F8_E4M3" || s == "F8_E5M2") return 1;
  if (s == "U16" || s == "I16" || s == "F16" || s == "BF16") return 2;
  if (s == "U32" || s == "I32" || s == "F32") return 4;
  if (s == "U64" || s == "I64" || s == "F64") return 8;
  return 0;
}

// The model's config keys, for shape errors.
std::string config_hint(const ModelConfig& m) {
  return str_cat("the config has model.n_layer=", m.n_layer, ", n_head=", m.n_head, ", d_model=", m.d_model,
                 ", seq_len=", m.seq_len, ", vocab_size=", m.vocab_size);
}

size_t find_param(const HostModel& m, const std::string& name) {
  for (size_t i = 0; i < m.params.size(); ++i)
    if (m.params[i].name == name) return i;
  return m.params.size();
}

void init_values(HostModel& m) {
  m.values.assign(m.params.size(), {});
  for (size_t i = 0; i < m.params.size(); ++i) m.values[i].assign(size_t(m.params[i].shard.global.numel()), 0.0f);
}

// Hugging Face's causal-mask buffers: h.<l>.attn.bias and h.<l>.attn.masked_bias.
bool is_attention_buffer(const std::string& name) {
  if (name.rfind("h.", 0) != 0) return false;
  size_t i = 2;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  if (i == 2 || i >= name.size() || name[i] != '.') return false;
  const std::string rest = name.substr(i + 1);
  return rest == "attn.bias" || rest == "attn.masked_bias";
}

struct StTensor {
  std::string name;            // as stored
  std::string dtype_name;      // "F32", "BF16", "BOOL", ...
  std::optional<DType> dtype;  // the float dtypes this reader converts
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

// Parses and checks a safetensors header; data_start is where the data section begins.
std::vector<StTensor> read_st_header(const InFile& f, uint64_t& data_start) {
  const std::string& path = f.path();
  if (f.size() < 8)
    fail(ErrorKind::Data, "'", path, "' is truncated: ", f.size(), " bytes, less than a safetensors header length");
  uint64_t n = 0;
  f.read(0, &n, 8, "the header length");
  if (n > kMaxHeaderBytes) fail(ErrorKind::Data, "'", path, "' is not a safetensors file: header length ", n, " bytes");
  std::string text(size_t(n), '\0');
  f.read(8, text.data(), n, "the JSON header");
  data_start = 8 + n;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) fail(ErrorKind::Data, "'", path, "': the safetensors header is not a JSON object");
  std::vector<StTensor> out;
  for (const auto& [key, v] : j.items()) {
    if (key == "__metadata__") continue;
    auto bad = [&](const std::string& why) { fail(ErrorKind::Data, "'", path, "': tensor '", key, "' ", why); };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      bad("lacks dtype, shape or data_offsets");
    StTensor t;
    t.name = key;
    const uint64_t es = v["dtype"].is_string() ? st_element_size(v["dtype"].get<std::string>()) : 0;
    if (es == 0) bad(str_cat("has dtype ", v["dtype"].dump(), ", which is no safetensors dtype"));
    t.dtype_name = v["dtype"].get<std::string>();
    t.dtype = st_dtype(t.dtype_name);
    const auto& shape = v["shape"];
    if (!shape.is_array() || shape.size() > size_t(Shape::kMaxRank)) bad("has no valid shape");
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) bad(str_cat("has shape ", shape.dump(), "; expected non-negative integers"));
      t.shape.push_back(d.get<int64_t>());
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned() ||
        off[0].get<uint64_t>() > off[1].get<uint64_t>())
      bad(str_cat("has data_offsets ", off.dump(), "; expected [begin, end]"));
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    const uint64_t need = uint64_t(t.shape.numel()) * es;
    if (t.end - t.begin != need)
      bad(str_cat("has data_offsets [", t.begin, ", ", t.end, "): ", t.end - t.begin, " bytes, but ", shape.dump(),
                  " of ", t.dtype_name, " needs ", need));
    if (data_start + t.end > f.size())
      fail(ErrorKind::Data, "'", path, "' is truncated: tensor '", key, "' ends at byte ", data_start + t.end,
           " but the file has ", f.size());
    out.push_back(std::move(t));
  }
  return out;
}

// A stored tensor's values as f32.
std::vector<float> load(const InFile& f, uint64_t data_start, const StTensor& t) {
  if (!t.dtype)
    fail(ErrorKind::Data, "'", f.path(), "': tensor '", t.name, "' has dtype ", t.dtype_name,
         "; expected F32, BF16, F16 or F64");
  std::vector<unsigned char> raw(size_t(t.end - t.begin));
  f.read(data_start + t.begin, raw.data(), raw.size(), "tensor '" + t.name + "'");
  std::vector<float> v(size_t(t.shape.numel()));
  convert_elements(raw.data(), *t.dtype, v.data(), DType::F32, int64_t(v.size()));
  return v;
}

}  // namespace

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::optional<ModelFormat> sniff_model_file(const std::string& path) {
  InFile f(path);
  unsigned char head[9] = {};
  const uint64_t n = std::min<uint64_t>(f.size(), sizeof head);
  f.read(0, head, n, "the first bytes");
  int32_t magic = 0;
  if (n >= 4) std::memcpy(&magic, head, 4);
  if (magic == kLlmcMagic) return ModelFormat::LlmC;
  uint64_t len = 0;
  if (n == 9) std::memcpy(&len, head, 8);
  // A plausible header length followed by a JSON object; the reader checks the rest.
  if (n == 9 && head[8] == '{' && len >= 2 && len <= kMaxHeaderBytes) return ModelFormat::Safetensors;
  return std::nullopt;
}

void read_hf_safetensors(const std::string& path, const ModelConfig& mc, HostModel& m) {
  const ModelDims s = model_dims(mc);
  init_values(m);
  InFile f(path);
  uint64_t data_start = 0;
  const std::vector<StTensor> tensors = read_st_header(f, data_start);
  // Match every stored tensor to a parameter and check its shape before reading any data.
  std::vector<const StTensor*> source(m.params.size(), nullptr);
  const StTensor* lm_head = nullptr;
  for (const StTensor& t : tensors) {
    const bool prefixed = t.name.rfind(kHfPrefix, 0) == 0;
    const std::string name = prefixed ? t.name.substr(sizeof kHfPrefix - 1) : t.name;
    if (name == "lm_head.weight") {
      lm_head = &t;
      continue;
    }
    if (is_attention_buffer(name)) continue;
    const size_t i = find_param(m, name);
    if (i == m.params.size())
      fail(ErrorKind::Data, "'", path, "': tensor '", t.name, "' is no parameter of the GPT-2 the config describes (",
           config_hint(mc), ")");
    if (source[i])
      fail(ErrorKind::Data, "'", path, "' holds '", name, "' twice: '", source[i]->name, "' and '", t.name, "'");
    const Shape want = hf_shape(m.params[i], s);
    const bool padded_wte = name == "wte.weight" && t.shape == Shape{s.padded_vocab(), s.d_model};
    if (t.shape != want && !padded_wte)
      fail(ErrorKind::Data, "'", path, "': tensor '", t.name, "' has shape ", t.shape.str(), ", expected ", want.str(),
           " (", config_hint(mc), ")");
    source[i] = &t;
  }
  for (size_t i = 0; i < m.params.size(); ++i)
    if (!source[i])
      fail(ErrorKind::Data, "'", path, "' has no tensor '", kHfPrefix, m.params[i].name, "' (nor '", m.params[i].name,
           "'), which the config's model needs (", config_hint(mc), ")");

  const size_t wte = find_param(m, "wte.weight");
  const size_t real = size_t(s.vocab_size) * size_t(s.d_model);  // the unpadded rows' elements
  for (size_t i = 0; i < m.params.size(); ++i) {
    const StTensor& t = *source[i];
    std::vector<float> v = load(f, data_start, t);
    if (i == wte) std::copy(v.begin(), v.begin() + real, m.values[i].begin());  // padding rows stay zero
    else if (hf_transposed(m.params[i])) m.values[i] = transposed(v, t.shape[0], t.shape[1]);
    else m.values[i] = std::move(v);
  }
  if (lm_head) {
    // Tied, as GPT-2 is: the head is the token table, kept once.
    if (lm_head->shape != Shape{s.vocab_size, s.d_model} && lm_head->shape != Shape{s.padded_vocab(), s.d_model})
      fail(ErrorKind::Data, "'", path, "': tensor '", lm_head->name, "' has shape ", lm_head->shape.str(),
           ", expected ", Shape{s.vocab_size, s.d_model}.str(), " (the token table's)");
    const std::vector<float> head = load(f, data_start, *lm_head);
    if (std::memcmp(head.data(), m.values[wte].data(), real * sizeof(float)) != 0)
      fail(ErrorKind::Data, "'", path, "': '", lm_head->name,
           "' differs from the token table; only a head tied to wte is supported");
  }
}

void read_llmc_model(const std::string& path, const ModelConfig& mc, HostModel& m) {
  init_values(m);
  InFile f(path);
  int32_t h[256] = {};
  // The magic first: a file of another kind is named as such, not as a short llm.c file.
  f.read(0, h, std::min<uint64_t>(f.size(), sizeof(int32_t)), "the magic number");
  if (h[0] != kLlmcMagic)
    fail(ErrorKind::Data, "'", path, "' is not an llm.c model file: magic number ", h[0], ", expected ", kLlmcMagic);
  if (f.size() < kLlmcHeaderBytes)
    fail(ErrorKind::Data, "'", path, "' is truncated: ", f.size(), " bytes, less than the 1024-byte llm.c header");
  f.read(0, h, kLlmcHeaderBytes, "the header");
  if (h[1] != 3 && h[1] != 5)
    fail(ErrorKind::Data, "'", path, "': llm.c model file version ", h[1], " is not supported (3: fp32, 5: bf16)");
  const DType stored = h[1] == 3 ? DType::F32 : DType::BF16;
  struct Field {
    int at;
    const char *header, *key;
    int config;
  };
  for (const Field& x : {Field{2, "max_seq_len", "model.seq_len", mc.seq_len},
                         Field{3, "vocab_size", "model.vocab_size", mc.vocab_size},
                         Field{4, "n_layer", "model.n_layer", mc.n_layer}, Field{5, "n_head", "model.n_head", mc.n_head},
                         Field{6, "channels", "model.d_model", mc.d_model}})
    if (h[x.at] != x.config)
      fail(ErrorKind::Data, "'", path, "': the llm.c header has ", x.header, " ", h[x.at], " but the config has ", x.key,
           "=", x.config);
  const int64_t V = mc.vocab_size, Vp = h[7], C = mc.d_model, L = mc.n_layer;
  if (Vp < V) fail(ErrorKind::Data, "'", path, "': the llm.c header has padded_vocab_size ", Vp, " < vocab_size ", V);

  // File order: wte (Vp, C), wpe, then each block tensor for all layers at once, then ln_f.
  static constexpr const char* kBlockTensors[] = {
      "ln_1.weight",      "ln_1.bias",      "attn.c_attn.weight", "attn.c_attn.bias",
      "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",      "ln_2.bias",
      "mlp.c_fc.weight",  "mlp.c_fc.bias",  "mlp.c_proj.weight", "mlp.c_proj.bias"};
  std::vector<size_t> order{find_param(m, "wpe.weight")};
  for (const char* t : kBlockTensors)
    for (int64_t l = 0; l < L; ++l) order.push_back(find_param(m, str_cat("h.", l, ".", t)));
  order.push_back(find_param(m, "ln_f.weight"));
  order.push_back(find_param(m, "ln_f.bias"));
  uint64_t count = uint64_t(Vp * C);
  for (size_t i : order) {
    XR_CHECK(i < m.params.size(), "llm.c tensor order names a parameter the model lacks");
    count += uint64_t(m.params[i].shard.global.numel());
  }
  const uint64_t es = dtype_size(stored), want = kLlmcHeaderBytes + count * es;
  if (f.size() < want)
    fail(ErrorKind::Data, "'", path, "' is truncated: ", f.size(), " bytes, but the ", count,
         " parameters its header describes need ", want);
  if (f.size() > want)
    fail(ErrorKind::Data, "'", path, "' has ", f.size() - want, " bytes more than the ", want, " its header describes");

  uint64_t at = kLlmcHeaderBytes;
  std::vector<unsigned char> raw;
  auto next = [&](int64_t n, std::vector<float>& out, const std::string& what) {
    raw.resize(size_t(n) * es);
    f.read(at, raw.data(), raw.size(), what);
    at += raw.size();
    out.resize(size_t(n));
    convert_elements(raw.data(), stored, out.data(), DType::F32, n);
  };
  std::vector<float> wte;
  next(Vp * C, wte, "wte");
  const size_t wi = find_param(m, "wte.weight");
  std::copy(wte.begin(), wte.begin() + V * C, m.values[wi].begin());  // our padding rows stay zero
  for (size_t i : order) next(m.params[i].shard.global.numel(), m.values[i], m.params[i].name);
}

int64_t write_hf_safetensors(const std::string& path, const std::string& config_json, const ModelDims& shape,
                             const std::vector<Parameter>& params, DType dtype, int64_t step,
                             const std::function<void(const Parameter&, std::vector<float>&)>& read_global) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    fail(ErrorKind::Usage, "safetensors export in ", dtype_name(dtype), ": expected f32, bf16 or f16");
  nlohmann::json header;
  header["__metadata__"] = {{"format", "pt"}, {"producer", "xirang ckpt convert"}, {"step", std::to_string(step)}};
  uint64_t offset = 0;
  for (const Parameter& p : params) {
    const Shape hs = hf_shape(p, shape);
    std::vector<int64_t> dims;
    for (int d = 0; d < hs.rank(); ++d) dims.push_back(hs[d]);
    const uint64_t bytes = uint64_t(hs.numel()) * dtype_size(dtype);
    header[kHfPrefix + p.name] = {{"dtype", st_dtype_name(dtype)},
                                  {"shape", dims},
                                  {"data_offsets", std::vector<uint64_t>{offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  AtomicFile out(path);
  const uint64_t n = text.size();
  out.write(&n, 8);
  out.write(text.data(), text.size());
  std::vector<float> values;
  std::vector<unsigned char> bytes;
  for (const Parameter& p : params) {
    read_global(p, values);
    const Shape& g = p.shard.global;
    if (p.name == "wte.weight") values.resize(size_t(shape.vocab_size) * size_t(g[1]));  // the real rows come first
    else if (hf_transposed(p)) values = transposed(values, g[0], g[1]);
    bytes.resize(values.size() * dtype_size(dtype));
    convert_elements(values.data(), DType::F32, bytes.data(), dtype, int64_t(values.size()));
    out.write(bytes.data(), bytes.size());
  }
  const char* torch_dtype = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  const nlohmann::json config = {{"architectures", {"GPT2LMHeadModel"}},
                                 {"model_type", "gpt2"},
                                 {"n_embd", shape.d_model},
                                 {"n_layer", shape.n_layer},
                                 {"n_head", shape.n_head},
                                 {"n_positions", shape.max_seq_len},
                                 {"n_ctx", shape.max_seq_len},
                                 {"vocab_size", shape.vocab_size},
                                 {"activation_function", "gelu_new"},
                                 {"layer_norm_epsilon", kLayerNormEps},
                                 {"tie_word_embeddings", true},
                                 {"torch_dtype", torch_dtype}};
  AtomicFile cfg(config_json);
  const std::string config_text = config.dump(2) + "\n";
  cfg.write(config_text.data(), config_text.size());
  out.commit();
  cfg.commit();
  return int64_t(params.size());
}

}  // namespace xirang
