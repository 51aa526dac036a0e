// Hugging Face safetensors and llm.c model files (runtime/checkpoint/model_files.h).
#include "runtime/checkpoint/model_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

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

constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;  // safetensors' own limit
constexpr uint64_t kLlmcHeaderBytes = sizeof(LlmcHeader);
static_assert(kLlmcHeaderBytes == 1024, "llm.c headers are 256 int32");

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
std::string config_hint(const ModelDims& m) {
  return str_cat("the config has model.n_layer=", m.n_layer, ", n_head=", m.n_head, ", d_model=", m.d_model,
                 ", seq_len=", m.max_seq_len, ", vocab_size=", m.vocab_size);
}

void init_values(HostModel& m) {
  m.values.assign(m.params.size(), {});
  for (size_t i = 0; i < m.params.size(); ++i) m.values[i].assign(size_t(m.params[i].shard.global.numel()), 0.0f);
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
  for (const auto& item : j.items()) {
    const std::string& key = item.key();  // not a structured binding: the lambda below captures it
    const nlohmann::json& v = item.value();
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
    // Element count checked as it grows: a hostile shape must not overflow it.
    uint64_t elements = 1;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) bad(str_cat("has shape ", shape.dump(), "; expected non-negative integers"));
      const uint64_t dim = d.get<uint64_t>();
      if (dim > uint64_t(INT64_MAX) || (dim != 0 && elements > uint64_t(INT64_MAX) / dim / es))
        bad(str_cat("has shape ", shape.dump(), ": more bytes than any file holds"));
      elements *= dim;
      t.shape.push_back(int64_t(dim));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned() ||
        off[0].get<uint64_t>() > off[1].get<uint64_t>())
      bad(str_cat("has data_offsets ", off.dump(), "; expected [begin, end]"));
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    const uint64_t need = elements * es;
    if (t.end - t.begin != need)
      bad(str_cat("has data_offsets [", t.begin, ", ", t.end, "): ", t.end - t.begin, " bytes, but ", shape.dump(),
                  " of ", t.dtype_name, " needs ", need));
    if (t.end > f.size() - data_start)  // data_start <= size: the header was read
      fail(ErrorKind::Data, "'", path, "' is truncated: tensor '", key, "' ends at byte ", t.end,
           " of the data section, which starts at byte ", data_start, " of a file of ", f.size());
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

// The tensors of a safetensors file matched to the parameters of a HostModel.
struct HfMatch {
  struct Copy {
    const StTensor* tensor;
    size_t param;
    std::string what;  // the parameter, in messages
  };
  std::vector<std::vector<ForeignTensor>> foreign;   // per parameter: how the adapter stores it (its parts)
  std::vector<std::vector<const StTensor*>> source;  // per parameter and part: the tensor that holds it
  std::vector<Copy> copies;                          // tied copies, checked against their parameter once it is read
};

size_t param_index(const std::vector<Parameter>& params, const std::string& name) {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].name == name) return i;
  fail(ErrorKind::Internal, "the file adapter names parameter '", name, "', which the model lacks");
}

// A stored tensor whose name is no parameter's: a tied copy (its shape
// checked as its parameter's) or an ignored buffer.
void match_extra(const std::string& path, const ModelFileAdapter& files, const HostModel& m,
                 const StTensor& t, HfMatch& match) {
  const ExtraTensor x = files.hf_extra(t.name);
  if (x.kind == ExtraTensor::Kind::Ignored) return;
  XR_CHECK(x.kind == ExtraTensor::Kind::TiedCopy, "tensor '", t.name, "': unknown names are refused before");
  const size_t i = param_index(m.params, x.param);
  XR_CHECK(match.foreign[i].size() == 1, "a tied copy of '", x.param, "', which is stored in parts");
  const ForeignTensor& want = match.foreign[i][0];
  if (!foreign_accepts(want, m.params[i].shard.global, t.shape))
    fail(ErrorKind::Data, "'", path, "': tensor '", t.name, "' has shape ", t.shape.str(), ", expected ",
         want.shape.str(), " (", x.what, "'s)");
  match.copies.push_back({&t, i, x.what});
}

// Every parameter's tensors, by the adapter's names, with their shapes
// checked against the config before any data is read.
HfMatch match_hf_tensors(const std::string& path, const ModelDims& dims, const ModelFileAdapter& files,
                         const HostModel& m, const std::vector<StTensor>& tensors) {
  HfMatch match;
  std::map<std::string, std::pair<size_t, size_t>, std::less<>> by_name;  // (parameter, part)
  for (size_t i = 0; i < m.params.size(); ++i) {
    match.foreign.push_back(files.hf_tensors(m.params[i], dims));
    XR_CHECK(!match.foreign.back().empty(), "the file adapter stores '", m.params[i].name, "' as no tensor");
    if (match.foreign.back().size() > 1) {  // parts: consecutive row blocks that cover the parameter
      int64_t row = 0;
      for (const ForeignTensor& t : match.foreign.back()) {
        XR_CHECK(t.row_begin == row && t.row_end > row, "the file adapter's parts of '", m.params[i].name,
                 "' are not consecutive row blocks");
        row = t.row_end;
      }
      XR_CHECK(row == m.params[i].shard.global[0], "the file adapter's parts of '", m.params[i].name, "' cover ", row,
               " of its rows");
    }
    for (size_t k = 0; k < match.foreign.back().size(); ++k)
      for (const std::string& n : match.foreign.back()[k].names)
        XR_CHECK(by_name.emplace(n, std::make_pair(i, k)).second, "the file adapter gives two tensors the name '", n,
                 "'");
    match.source.emplace_back(match.foreign.back().size(), nullptr);
  }
  // Names first: a file of another model is named as such, not by the
  // first shape that happens to differ.
  for (const StTensor& t : tensors)
    if (!by_name.count(t.name) && files.hf_extra(t.name).kind == ExtraTensor::Kind::Unknown)
      fail(ErrorKind::Data, "'", path, "': tensor '", t.name, "' is no parameter of the ", files.model_name(),
           " the config describes (", config_hint(dims), ")");
  for (const StTensor& t : tensors) {
    const auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      match_extra(path, files, m, t, match);
      continue;
    }
    const auto [i, k] = it->second;
    const ForeignTensor& want = match.foreign[i][k];
    if (match.source[i][k])
      fail(ErrorKind::Data, "'", path, "' holds '", want.names.at(0), "' twice: '", match.source[i][k]->name,
           "' and '", t.name, "'");
    if (!foreign_accepts(want, m.params[i].shard.global, t.shape))
      fail(ErrorKind::Data, "'", path, "': tensor '", t.name, "' has shape ", t.shape.str(), ", expected ",
           want.shape.str(), " (", config_hint(dims), ")");
    match.source[i][k] = &t;
  }
  for (size_t i = 0; i < m.params.size(); ++i)
    for (size_t k = 0; k < match.source[i].size(); ++k) {
      if (match.source[i][k]) continue;
      const std::vector<std::string>& names = match.foreign[i][k].names;
      std::string others;
      for (size_t n = 1; n < names.size(); ++n) others += str_cat(n == 1 ? " (nor '" : ", '", names[n], "'");
      if (!others.empty()) others += ")";
      fail(ErrorKind::Data, "'", path, "' has no tensor '", names.at(0), "'", others,
           ", which the config's model needs (", config_hint(dims), ")");
    }
  return match;
}

// The config.json beside a safetensors file, when there is one, checked
// against the config: a file of another architecture or other dimensions
// is named by its config.json field before any tensor is read.
void check_hf_config(const std::string& path, const ModelDims& dims, const ModelFileAdapter& files) {
  const size_t slash = path.find_last_of('/');
  const std::string config_json = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + "config.json";
  struct stat st;
  if (::stat(config_json.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  const InFile f(config_json);
  std::string text(size_t(f.size()), '\0');
  f.read(0, text.data(), f.size(), "config.json");
  const std::string problem = files.hf_config_problem(text, dims);
  if (!problem.empty()) fail(ErrorKind::Data, "'", config_json, "': ", problem);
}

// Reads an llm.c header after checking its magic number, its length and
// its version; returns the dtype of the values that follow.
DType read_llmc_header(const InFile& f, LlmcHeader& h) {
  const std::string& path = f.path();
  // The magic first: a file of another kind is named as such, not as a short llm.c file.
  f.read(0, h.data(), std::min<uint64_t>(f.size(), sizeof(int32_t)), "the magic number");
  if (h[0] != kLlmcMagic)
    fail(ErrorKind::Data, "'", path, "' is not an llm.c model file: magic number ", h[0], ", expected ", kLlmcMagic);
  if (f.size() < kLlmcHeaderBytes)
    fail(ErrorKind::Data, "'", path, "' is truncated: ", f.size(), " bytes, less than the 1024-byte llm.c header");
  f.read(0, h.data(), kLlmcHeaderBytes, "the header");
  if (h[1] != 3 && h[1] != 5)
    fail(ErrorKind::Data, "'", path, "': llm.c model file version ", h[1], " is not supported (3: fp32, 5: bf16)");
  return h[1] == 3 ? DType::F32 : DType::BF16;
}

// The JSON header of a safetensors file holding `tensors` in `dtype`, padded
// with spaces so that the data section starts 8-byte aligned.
std::string st_header_text(const std::vector<ForeignTensor>& tensors, DType dtype, int64_t step) {
  nlohmann::json header;
  header["__metadata__"] = {{"format", "pt"}, {"producer", "xirang ckpt convert"}, {"step", std::to_string(step)}};
  uint64_t offset = 0;
  for (const ForeignTensor& t : tensors) {
    std::vector<int64_t> dims;
    for (int d = 0; d < t.shape.rank(); ++d) dims.push_back(t.shape[d]);
    const uint64_t bytes = uint64_t(t.shape.numel()) * dtype_size(dtype);
    header[t.names.at(0)] = {{"dtype", st_dtype_name(dtype)},
                             {"shape", dims},
                             {"data_offsets", std::vector<uint64_t>{offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
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

void read_hf_safetensors(const std::string& path, const ModelDims& dims, const ModelFileAdapter& files,
                         HostModel& m) {
  init_values(m);
  InFile f(path);
  check_hf_config(path, dims, files);
  uint64_t data_start = 0;
  const std::vector<StTensor> tensors = read_st_header(f, data_start);
  const HfMatch match = match_hf_tensors(path, dims, files, m, tensors);
  for (size_t i = 0; i < m.params.size(); ++i)
    for (size_t k = 0; k < match.source[i].size(); ++k) {
      const StTensor& t = *match.source[i][k];
      from_foreign(match.foreign[i][k], t.shape, load(f, data_start, t), m.params[i].shard.global, m.values[i]);
    }
  for (const HfMatch::Copy& c : match.copies) {
    std::vector<float> copy(m.values[c.param].size(), 0.0f);
    from_foreign(match.foreign[c.param][0], c.tensor->shape, load(f, data_start, *c.tensor),
                 m.params[c.param].shard.global, copy);
    if (std::memcmp(copy.data(), m.values[c.param].data(), copy.size() * sizeof(float)) != 0)
      fail(ErrorKind::Data, "'", path, "': '", c.tensor->name, "' differs from ", c.what, "; ", files.model_name(),
           " supports only a copy tied to it");
  }
}

void read_llmc_model(const std::string& path, const ModelDims& dims, const ModelFileAdapter& files, HostModel& m) {
  init_values(m);
  InFile f(path);
  LlmcHeader h{};
  const DType stored = read_llmc_header(f, h);
  const std::string problem = files.llmc_header_problem(h, dims);
  if (!problem.empty()) fail(ErrorKind::Data, "'", path, "': ", problem);
  const std::vector<LlmcTensor> tensors = files.llmc_tensors(h, m.params, dims);
  std::vector<int> filled(m.params.size(), 0);
  uint64_t count = 0;
  for (const LlmcTensor& t : tensors) {
    XR_CHECK(t.param < m.params.size() && ++filled[t.param] == 1, "llm.c tensor order: parameter ", t.param);
    count += uint64_t(t.stored.shape.numel());
  }
  XR_CHECK(std::count(filled.begin(), filled.end(), 1) == ptrdiff_t(m.params.size()),
           "llm.c tensor order leaves parameters out");
  const uint64_t es = dtype_size(stored), want = kLlmcHeaderBytes + count * es;
  if (f.size() < want)
    fail(ErrorKind::Data, "'", path, "' is truncated: ", f.size(), " bytes, but the ", count,
         " parameters its header describes need ", want);
  if (f.size() > want)
    fail(ErrorKind::Data, "'", path, "' has ", f.size() - want, " bytes more than the ", want, " its header describes");

  uint64_t at = kLlmcHeaderBytes;
  std::vector<unsigned char> raw;
  for (const LlmcTensor& t : tensors) {
    const Parameter& p = m.params[t.param];
    const int64_t n = t.stored.shape.numel();
    raw.resize(size_t(n) * es);
    f.read(at, raw.data(), raw.size(), p.name);
    at += raw.size();
    std::vector<float> v(static_cast<size_t>(n));
    convert_elements(raw.data(), stored, v.data(), DType::F32, n);
    from_foreign(t.stored, t.stored.shape, std::move(v), p.shard.global, m.values[t.param]);
  }
}

int64_t write_hf_safetensors(const std::string& path, const std::string& config_json, const ModelDims& dims,
                             const ModelFileAdapter& files, const std::vector<Parameter>& params, DType dtype,
                             int64_t step, const std::function<void(const Parameter&, std::vector<float>&)>& read_global) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    fail(ErrorKind::Usage, "safetensors export in ", dtype_name(dtype), ": expected f32, bf16 or f16");
  std::vector<std::vector<ForeignTensor>> foreign;  // per parameter, its parts
  std::vector<ForeignTensor> stored;                // every part, in file order
  for (const Parameter& p : params) {
    foreign.push_back(files.hf_tensors(p, dims));
    stored.insert(stored.end(), foreign.back().begin(), foreign.back().end());
  }
  const std::string text = st_header_text(stored, dtype, step);
  AtomicFile out(path);
  const uint64_t n = text.size();
  out.write(&n, 8);
  out.write(text.data(), text.size());
  std::vector<float> values;
  std::vector<unsigned char> bytes;
  for (size_t i = 0; i < params.size(); ++i) {
    read_global(params[i], values);
    for (const ForeignTensor& t : foreign[i]) {
      const std::vector<float> part = to_foreign(t, params[i].shard.global, values);
      bytes.resize(part.size() * dtype_size(dtype));
      convert_elements(part.data(), DType::F32, bytes.data(), dtype, int64_t(part.size()));
      out.write(bytes.data(), bytes.size());
    }
  }
  AtomicFile cfg(config_json);
  const std::string config_text = files.hf_config_json(dims, dtype);
  cfg.write(config_text.data(), config_text.size());
  out.commit();
  cfg.commit();
  return int64_t(stored.size());
}

}  // namespace xirang
