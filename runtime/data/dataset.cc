#include "runtime/data/dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "runtime/data/dataset_index.h"

namespace xirang {

namespace fs = std::filesystem;

// Shards are mapped and read in place, so their little-endian layout must be
// the host's; every machine we target (x86-64, aarch64, GPUs' hosts) is.
static_assert(std::endian::native == std::endian::little, "token shards assume a little-endian host");

namespace {

constexpr const char* kIndexFile = "index.json";

std::string join(const std::string& dir, const std::string& file) { return (fs::path(dir) / file).string(); }

size_t token_bytes(DType t) { return t == DType::U32 ? 4 : 2; }

void put_u32(unsigned char* p, uint32_t v) { std::memcpy(p, &v, 4); }
void put_u64(unsigned char* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get_u32(const unsigned char* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
uint64_t get_u64(const unsigned char* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  fail(ErrorKind::Data, "cannot ", what, " '", path, "': ", std::strerror(errno));
}

// Makes a completed file durable before it becomes visible under its final
// name, so a crash never leaves a named file with missing contents.
void flush_and_close(std::FILE* f, const std::string& path) {
  bool ok = std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  int err = errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    errno = err;
    fail_io("write", path);
  }
}

void rename_into_place(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) fail_io(str_cat("rename '", from, "' to"), to);
}

}  // namespace

DType token_dtype_for_vocab(int64_t vocab_size) { return vocab_size <= 65536 ? DType::U16 : DType::U32; }

uint64_t fnv1a64(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

// ---------------------------------------------------------------- writer

DatasetWriter::DatasetWriter(std::string dir, std::string tokenizer, int64_t vocab_size, int64_t eot_token,
                             int64_t shard_tokens, bool overwrite)
    : dir_(std::move(dir)), shard_tokens_(shard_tokens) {
  if (tokenizer.empty()) fail(ErrorKind::Data, "dataset '", dir_, "': the tokenizer name is empty");
  if (vocab_size < 1 || vocab_size > (int64_t(1) << 32))
    fail(ErrorKind::Data, "dataset '", dir_, "': vocab_size ", vocab_size, " is out of range (expected 1..4294967296)");
  if (eot_token < -1 || eot_token >= vocab_size)
    fail(ErrorKind::Data, "dataset '", dir_, "': eot_token ", eot_token, " is outside [-1, ", vocab_size, ")");
  if (shard_tokens < 1) fail(ErrorKind::Data, "dataset '", dir_, "': shard_tokens ", shard_tokens, " must be positive");
  index_.tokenizer = std::move(tokenizer);
  index_.vocab_size = vocab_size;
  index_.token_dtype = token_dtype_for_vocab(vocab_size);
  index_.eot_token = eot_token;

  std::error_code ec;
  if (fs::exists(dir_, ec)) {
    if (!fs::is_directory(dir_, ec))
      fail(ErrorKind::Data, "dataset directory '", dir_, "' exists and is not a directory");
    if (!fs::is_empty(dir_, ec)) {
      if (!overwrite)
        fail(ErrorKind::Data, "dataset directory '", dir_,
             "' exists and is not empty; refusing to overwrite it (xirang data prepare --force allows it)");
      // The index goes first: from then on the directory is no longer a dataset.
      fs::remove(join(dir_, kIndexFile), ec);
      if (ec) fail(ErrorKind::Data, "cannot remove '", join(dir_, kIndexFile), "': ", ec.message());
      fs::directory_iterator it(dir_, ec);
      if (ec) fail(ErrorKind::Data, "cannot list dataset directory '", dir_, "': ", ec.message());
      for (const auto& e : it) {
        std::string name = e.path().filename().string();
        bool ours = (name.rfind("shard_", 0) == 0 && (name.ends_with(".bin") || name.ends_with(".bin.tmp"))) ||
                    name == "index.json.tmp";
        if (ours && !fs::remove(e.path(), ec))
          fail(ErrorKind::Data, "cannot remove '", e.path().string(), "': ", ec.message());
      }
    }
  }
  fs::create_directories(dir_, ec);
  if (ec) fail(ErrorKind::Data, "cannot create dataset directory '", dir_, "': ", ec.message());
}

DatasetWriter::~DatasetWriter() {
  if (file_) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
}

void DatasetWriter::add_document(const int32_t* ids, size_t n) {
  XR_CHECK(!finished_, "add_document after finish on dataset '", dir_, "'");
  for (size_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= index_.vocab_size)
      fail(ErrorKind::Data, "dataset '", dir_, "': document ", documents_, " has token id ", ids[i], " at position ",
           i, ", outside the vocabulary [0, ", index_.vocab_size, ")");
  if (n == 0) return;
  // A document never starts at the very end of a shard: it would own no tokens there.
  if (file_ && current_.tokens == shard_tokens_) close_shard();
  if (!file_) open_shard();
  doc_starts_.push_back(uint64_t(current_.tokens));
  ++current_.documents;
  ++documents_;
  write_tokens(ids, n);
}

void DatasetWriter::write_tokens(const int32_t* ids, size_t n) {
  const size_t tb = token_bytes(index_.token_dtype);
  constexpr size_t kChunk = size_t(1) << 16;
  while (n > 0) {
    if (current_.tokens == shard_tokens_) {
      close_shard();
      open_shard();
    }
    size_t take = std::min({n, kChunk, size_t(shard_tokens_ - current_.tokens)});
    buf_.resize(take * tb);
    if (tb == 2) {
      for (size_t i = 0; i < take; ++i) {
        uint16_t v = uint16_t(ids[i]);
        std::memcpy(&buf_[2 * i], &v, 2);
      }
    } else {
      std::memcpy(buf_.data(), ids, take * 4);  // ids are validated non-negative
    }
    if (std::fwrite(buf_.data(), 1, buf_.size(), file_) != buf_.size()) fail_io("write", tmp_path_);
    current_.checksum = fnv1a64(buf_.data(), buf_.size(), current_.checksum);
    current_.tokens += int64_t(take);
    index_.total_tokens += int64_t(take);
    ids += take;
    n -= take;
  }
}

void DatasetWriter::open_shard() {
  char name[32];
  std::snprintf(name, sizeof name, "shard_%05zu.bin", index_.shards.size());
  current_ = ShardInfo{name, 0, 0, fnv1a64(nullptr, 0)};
  doc_starts_.clear();
  tmp_path_ = join(dir_, current_.file) + ".tmp";
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  if (!file_) fail_io("create", tmp_path_);
  // The real header is written at close, once the counts are known.
  unsigned char zeros[kShardHeaderBytes] = {};
  if (std::fwrite(zeros, 1, sizeof zeros, file_) != sizeof zeros) fail_io("write", tmp_path_);
}

void DatasetWriter::close_shard() {
  doc_starts_.push_back(uint64_t(current_.tokens));
  size_t table_bytes = doc_starts_.size() * 8;
  if (std::fwrite(doc_starts_.data(), 1, table_bytes, file_) != table_bytes) fail_io("write", tmp_path_);

  unsigned char h[kShardHeaderBytes] = {};
  std::memcpy(h, kShardMagic, 8);
  put_u32(h + 8, kDatasetVersion);
  put_u32(h + 12, uint32_t(token_bytes(index_.token_dtype)));
  put_u64(h + 16, uint64_t(index_.vocab_size));
  put_u64(h + 24, uint64_t(current_.tokens));
  put_u64(h + 32, uint64_t(current_.documents));
  put_u64(h + 40, current_.checksum);
  if (std::fseek(file_, 0, SEEK_SET) != 0 || std::fwrite(h, 1, sizeof h, file_) != sizeof h)
    fail_io("write", tmp_path_);
  std::FILE* f = file_;
  file_ = nullptr;
  flush_and_close(f, tmp_path_);
  rename_into_place(tmp_path_, join(dir_, current_.file));
  index_.shards.push_back(current_);
}

const DatasetIndex& DatasetWriter::finish() {
  XR_CHECK(!finished_, "finish called twice on dataset '", dir_, "'");
  if (file_) close_shard();
  std::string text = index_json_text(index_);
  std::string tmp = join(dir_, "index.json.tmp");
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail_io("create", tmp);
  if (std::fwrite(text.data(), 1, text.size(), f) != text.size()) {
    std::fclose(f);
    fail_io("write", tmp);
  }
  flush_and_close(f, tmp);
  rename_into_place(tmp, join(dir_, kIndexFile));
  // Best effort: persist the renames themselves.
  int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  finished_ = true;
  return index_;
}

// ---------------------------------------------------------------- reader

struct TokenDataset::Shard {
  std::string path;
  void* map = nullptr;
  size_t map_bytes = 0;
  const unsigned char* tokens = nullptr;  // (n_tokens * token_bytes)
  const unsigned char* table = nullptr;   // (n_documents + 1) u64, possibly unaligned
  int64_t n_tokens = 0;
  int64_t n_documents = 0;
  uint64_t checksum = 0;

  Shard() = default;
  Shard(Shard&& o) noexcept { *this = std::move(o); }
  Shard& operator=(Shard&& o) noexcept {
    if (this != &o) {
      release();
      path = std::move(o.path);
      map = std::exchange(o.map, nullptr);
      map_bytes = std::exchange(o.map_bytes, 0);
      tokens = o.tokens;
      table = o.table;
      n_tokens = o.n_tokens;
      n_documents = o.n_documents;
      checksum = o.checksum;
    }
    return *this;
  }
  ~Shard() { release(); }
  void release() {
    if (map) ::munmap(map, map_bytes);
    map = nullptr;
  }
  uint64_t doc_offset(int64_t k) const { return get_u64(table + 8 * k); }
};

TokenDataset::TokenDataset(TokenDataset&&) noexcept = default;
TokenDataset& TokenDataset::operator=(TokenDataset&&) noexcept = default;
TokenDataset::~TokenDataset() = default;

namespace {

std::string u128_str(unsigned __int128 v) {
  std::string s;
  do {
    s.insert(s.begin(), char('0' + int(v % 10)));
    v /= 10;
  } while (v > 0);
  return s;
}

std::string printable(const unsigned char* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += (p[i] >= 0x20 && p[i] < 0x7f) ? char(p[i]) : '?';
  return s;
}


std::string read_index_text(const std::string& dir, const std::string& index_path) {
  std::error_code ec;
  if (!fs::is_regular_file(index_path, ec))
    fail(ErrorKind::Data, "no dataset at '", dir, "' (missing ", index_path, ")");
  std::ifstream in(index_path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) fail_io("read", index_path);
  return text.str();
}

using Shard = TokenDataset::Shard;

// Maps the whole shard file read-only; checks only that it can hold a header.
Shard map_shard(const std::string& path, const std::string& index_path) {
  Shard s;
  s.path = path;
  int fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) fail(ErrorKind::Data, "shard '", s.path, "' listed in '", index_path, "' is missing");
    fail_io("open shard", s.path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail_io("stat shard", s.path);
  }
  const uint64_t file_bytes = uint64_t(st.st_size);
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    fail(ErrorKind::Data, "shard '", s.path, "' is truncated: file has ", file_bytes, " bytes, less than the ",
         kShardHeaderBytes, "-byte header");
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) fail_io("map shard", s.path);
  s.map = map;
  s.map_bytes = file_bytes;
  return s;
}

// The header fields that must agree with the format and the index: magic,
// version, token width, vocabulary size, zero reserved bytes.
void check_shard_header(const Shard& s, const DatasetIndex& ix, size_t tb, const std::string& index_path) {
  const auto* h = static_cast<const unsigned char*>(s.map);
  if (std::memcmp(h, kShardMagic, 8) != 0)
    fail(ErrorKind::Data, "shard '", s.path, "' has bad magic '", printable(h, 8),
         "' (expected XRTOKEN1): not a xirang token shard");
  if (uint32_t v = get_u32(h + 8); v != kDatasetVersion)
    fail(ErrorKind::Data, "shard '", s.path, "' has version ", v, " (this build reads version ", kDatasetVersion, ")");
  if (uint32_t b = get_u32(h + 12); b != tb)
    fail(ErrorKind::Data, "shard '", s.path, "' stores ", b, "-byte tokens but '", index_path, "' says ",
         tb == 2 ? "uint16" : "uint32");
  if (uint64_t v = get_u64(h + 16); v != uint64_t(ix.vocab_size))
    fail(ErrorKind::Data, "shard '", s.path, "' has vocab_size ", v, " but '", index_path, "' says ", ix.vocab_size);
  for (size_t k = 48; k < kShardHeaderBytes; ++k)
    if (h[k] != 0) fail(ErrorKind::Data, "shard '", s.path, "' has non-zero reserved header byte ", k);
}

// The token and document counts and the checksum, checked against the file
// size and the index; then points s.tokens and s.table into the mapping.
void read_shard_counts(Shard& s, const ShardInfo& info, size_t tb, const std::string& index_path) {
  const auto* h = static_cast<const unsigned char*>(s.map);
  const uint64_t file_bytes = s.map_bytes;
  const uint64_t n_tokens = get_u64(h + 24), n_docs = get_u64(h + 32);
  // 128-bit arithmetic: a corrupt count must not wrap into a plausible size.
  const unsigned __int128 expected =
      (unsigned __int128)kShardHeaderBytes + (unsigned __int128)n_tokens * tb + ((unsigned __int128)n_docs + 1) * 8;
  if (expected > file_bytes)
    fail(ErrorKind::Data, "shard '", s.path, "' is truncated: header says ", n_tokens, " tokens (",
         u128_str(expected),
         " bytes with the document table), file has ", file_bytes, " bytes");
  if (expected < file_bytes)
    fail(ErrorKind::Data, "shard '", s.path, "' has ", file_bytes - uint64_t(expected),
         " unexpected bytes after its document table (header says ", n_tokens, " tokens and ", n_docs,
         " documents, ", uint64_t(expected), " bytes in all)");
  if (int64_t(n_tokens) != info.tokens || int64_t(n_docs) != info.documents)
    fail(ErrorKind::Data, "shard '", s.path, "' holds ", n_tokens, " tokens and ", n_docs, " documents but '",
         index_path, "' says ", info.tokens, " and ", info.documents);
  s.n_tokens = int64_t(n_tokens);
  s.n_documents = int64_t(n_docs);
  s.checksum = get_u64(h + 40);
  if (s.checksum != info.checksum)
    fail(ErrorKind::Data, "shard '", s.path, "' has checksum ", checksum_hex(s.checksum), " but '", index_path,
         "' says ", checksum_hex(info.checksum));
  s.tokens = h + kShardHeaderBytes;
  s.table = s.tokens + n_tokens * tb;
}

// Document starts: strictly increasing below n_tokens, then n_tokens. Only a
// later shard may begin with the tail of a previous document.
void check_document_table(const Shard& s, bool first) {
  const uint64_t n_tokens = uint64_t(s.n_tokens), n_docs = uint64_t(s.n_documents);
  uint64_t prev = 0;
  for (uint64_t k = 0; k < n_docs; ++k) {
    uint64_t off = s.doc_offset(int64_t(k));
    if (off >= n_tokens || (k > 0 && off <= prev))
      fail(ErrorKind::Data, "shard '", s.path, "' has a bad document table: document ", k, " starts at ", off,
           " (previous start ", prev, ", ", n_tokens, " tokens)");
    prev = off;
  }
  if (s.doc_offset(int64_t(n_docs)) != n_tokens)
    fail(ErrorKind::Data, "shard '", s.path, "' has a bad document table: its last entry is ",
         s.doc_offset(int64_t(n_docs)), " (expected ", n_tokens, ")");
  if (first && n_tokens > 0 && (n_docs == 0 || s.doc_offset(0) != 0))
    fail(ErrorKind::Data, "shard '", s.path, "' is the first shard but does not start with a document");
}

}  // namespace

TokenDataset TokenDataset::open(const std::string& dir) {
  const std::string index_path = join(dir, kIndexFile);
  TokenDataset ds;
  ds.dir_ = dir;
  ds.index_ = parse_index(read_index_text(dir, index_path), index_path);
  const size_t tb = token_bytes(ds.index_.token_dtype);
  ds.shard_starts_.push_back(0);
  ds.shard_doc_starts_.push_back(0);
  for (const ShardInfo& info : ds.index_.shards) {
    Shard s = map_shard(join(dir, info.file), index_path);
    check_shard_header(s, ds.index_, tb, index_path);
    read_shard_counts(s, info, tb, index_path);
    check_document_table(s, /*first=*/ds.shards_.empty());
    ds.shard_starts_.push_back(ds.shard_starts_.back() + s.n_tokens);
    ds.shard_doc_starts_.push_back(ds.shard_doc_starts_.back() + s.n_documents);
    ds.shards_.push_back(std::move(s));
  }
  return ds;
}

namespace {

// Copies n tokens to int32 and returns the largest id seen, so the caller can
// reject ids that a damaged shard holds outside the vocabulary.
template <class T>
uint32_t copy_tokens(const unsigned char* src, size_t n, int32_t* out) {
  uint32_t hi = 0;
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    hi = std::max<uint32_t>(hi, v);
    out[i] = int32_t(v);
  }
  return hi;
}

}  // namespace

void TokenDataset::read(int64_t begin, int64_t count, int32_t* out) const {
  if (begin < 0 || count < 0 || begin > num_tokens() - count)
    fail(ErrorKind::Data, "read of tokens [", begin, ", ", begin + count, ") is outside dataset '", dir_, "' of ",
         num_tokens(), " tokens");
  const size_t tb = token_bytes(index_.token_dtype);
  size_t s = size_t(std::upper_bound(shard_starts_.begin(), shard_starts_.end(), begin) - shard_starts_.begin()) - 1;
  while (count > 0) {
    const Shard& sh = shards_[s];
    int64_t local = begin - shard_starts_[s];
    int64_t take = std::min(count, sh.n_tokens - local);
    const unsigned char* src = sh.tokens + size_t(local) * tb;
    uint32_t hi = tb == 2 ? copy_tokens<uint16_t>(src, size_t(take), out) : copy_tokens<uint32_t>(src, size_t(take), out);
    if (int64_t(hi) >= index_.vocab_size)
      fail(ErrorKind::Data, "shard '", sh.path, "' holds token id ", hi, " near position ", local,
           ", outside the vocabulary of ", index_.vocab_size, " (the shard is corrupt)");
    out += take;
    begin += take;
    count -= take;
    ++s;
  }
}

int64_t TokenDataset::document_begin(int64_t i) const {
  size_t s = size_t(std::upper_bound(shard_doc_starts_.begin(), shard_doc_starts_.end(), i) -
                    shard_doc_starts_.begin()) - 1;
  return shard_starts_[s] + int64_t(shards_[s].doc_offset(i - shard_doc_starts_[s]));
}

std::pair<int64_t, int64_t> TokenDataset::document_span(int64_t i) const {
  if (i < 0 || i >= num_documents())
    fail(ErrorKind::Data, "document ", i, " is outside dataset '", dir_, "' of ", num_documents(), " documents");
  return {document_begin(i), i + 1 < num_documents() ? document_begin(i + 1) : num_tokens()};
}

void TokenDataset::verify_checksums(const std::function<void(int64_t done, int64_t total)>& progress) const {
  const size_t tb = token_bytes(index_.token_dtype);
  const int64_t total = num_tokens() * int64_t(tb);
  int64_t done = 0;
  for (const Shard& s : shards_) {
    uint64_t h = fnv1a64(s.tokens, size_t(s.n_tokens) * tb);
    if (h != s.checksum)
      fail(ErrorKind::Data, "shard '", s.path, "' is corrupt: checksum mismatch (its tokens hash to ", checksum_hex(h),
           ", its header records ", checksum_hex(s.checksum), ")");
    done += s.n_tokens * int64_t(tb);
    if (progress) progress(done, total);
  }
}

// ---------------------------------------------------------------- unigram baseline

std::vector<double> unigram_counts(const TokenDataset& ds) {
  const int64_t vocab = ds.index().vocab_size;
  std::vector<int64_t> counts(size_t(vocab), 0);
  const bool wide = ds.index().token_dtype == DType::U32;
  for (const TokenDataset::Shard& s : ds.shards_) {
    for (int64_t i = 0; i < s.n_tokens; ++i) {
      uint32_t v;
      if (wide) {
        std::memcpy(&v, s.tokens + 4 * i, 4);
      } else {
        uint16_t v16;
        std::memcpy(&v16, s.tokens + 2 * i, 2);
        v = v16;
      }
      if (int64_t(v) >= vocab)
        fail(ErrorKind::Data, "shard '", s.path, "' holds token id ", v, " at position ", i,
             ", outside the vocabulary of ", vocab, " (the shard is corrupt)");
      ++counts[v];
    }
  }
  return std::vector<double>(counts.begin(), counts.end());
}

double unigram_cross_entropy(const TokenDataset& train, const TokenDataset& val) {
  const DatasetIndex &a = train.index(), &b = val.index();
  if (a.tokenizer != b.tokenizer || a.vocab_size != b.vocab_size)
    fail(ErrorKind::Data, "datasets '", train.dir(), "' (", a.tokenizer, ", vocab ", a.vocab_size, ") and '",
         val.dir(), "' (", b.tokenizer, ", vocab ", b.vocab_size, ") use different vocabularies");
  if (val.num_tokens() == 0) fail(ErrorKind::Data, "dataset '", val.dir(), "' has no tokens to evaluate");
  std::vector<double> ct = unigram_counts(train), cv = unigram_counts(val);
  const double denom = double(train.num_tokens()) + double(a.vocab_size);
  double nll = 0;
  for (size_t t = 0; t < ct.size(); ++t)
    if (cv[t] > 0) nll -= cv[t] * std::log((ct[t] + 1.0) / denom);
  return nll / double(val.num_tokens());
}

}  // namespace xirang
