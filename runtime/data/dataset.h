// runtime/data/dataset.h: the on-disk token dataset: its format, writer and reader.
//
// A dataset split (train or val) is a directory holding index.json and binary
// shards shard_00000.bin, shard_00001.bin, ... `xirang data prepare` writes
// them with DatasetWriter; the data loader reads them through TokenDataset,
// which memory-maps every shard read-only and validates it on open, so a
// damaged dataset fails at start-up with one line naming the file, not as
// garbage tokens hours into a run.
//
//   DatasetWriter w("data/shakespeare/train", "bytes", 256, /*eot_token=*/-1);
//   w.add_document(ids.data(), ids.size());   // once per document
//   w.finish();                                // index.json is written last
//
//   TokenDataset ds = TokenDataset::open("data/shakespeare/train");
//   std::vector<int32_t> x(1025);
//   ds.read(/*begin=*/4096, x.size(), x.data());  // may span shard boundaries
//
// Shard layout (all integers little-endian; docs/data_format.md has more):
//
//   offset  size  field
//        0     8  magic "XRTOKEN1"
//        8     4  u32 version = 1
//       12     4  u32 token_bytes: 2 (uint16 tokens) or 4 (uint32 tokens)
//       16     8  u64 vocab_size
//       24     8  u64 n_tokens
//       32     8  u64 n_documents: documents that *start* in this shard
//       40     8  u64 checksum: FNV-1a 64 over the token bytes
//       48    16  reserved, zero
//       64        n_tokens tokens of token_bytes each
//                 (n_documents + 1) u64 document start offsets within the
//                 shard, non-decreasing, the last equal to n_tokens
//
// Shards are filled to exactly shard_tokens tokens (the last one may be
// shorter), so a document may continue from one shard into the next: tokens
// before a shard's first document offset belong to the previous shard's last
// document. Summing n_documents over the shards therefore counts each
// document once.
//
// index.json:
//   {"format": "xirang-tokens", "version": 1, "tokenizer": "bytes",
//    "vocab_size": 256, "token_dtype": "uint16", "eot_token": -1,
//    "total_tokens": N, "shards": [{"file": "shard_00000.bin", "tokens": n,
//    "documents": d, "checksum": "<16 hex digits>"}, ...]}
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace xirang {

inline constexpr char kShardMagic[8] = {'X', 'R', 'T', 'O', 'K', 'E', 'N', '1'};
inline constexpr uint32_t kDatasetVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;
inline constexpr const char* kDatasetFormat = "xirang-tokens";

struct ShardInfo {
  std::string file;       // name inside the split directory, e.g. "shard_00000.bin"
  int64_t tokens = 0;
  int64_t documents = 0;  // documents starting in this shard
  uint64_t checksum = 0;  // FNV-1a 64 over the shard's token bytes
};

struct DatasetIndex {
  std::string format = kDatasetFormat;
  int version = kDatasetVersion;
  std::string tokenizer;           // a make_tokenizer() name
  int64_t vocab_size = 0;
  DType token_dtype = DType::U16;  // U16 when vocab_size <= 65536, else U32
  int64_t eot_token = -1;          // document separator id, -1 when none
  int64_t total_tokens = 0;
  std::vector<ShardInfo> shards;
};

// Bytes per stored token for a vocabulary: 2 up to 65536 ids, else 4.
DType token_dtype_for_vocab(int64_t vocab_size);
// FNV-1a 64; `seed` chains calls so a checksum can be computed in pieces.
uint64_t fnv1a64(const void* data, size_t n, uint64_t seed = 0xcbf29ce484222325ull);

// Writes one split. Nothing in the directory looks like a dataset until
// finish() renames index.json into place; each shard is written under a
// ".tmp" name and renamed when complete, so a crash leaves no valid-looking
// partial shard. Not thread-safe.
class DatasetWriter {
 public:
  // Creates `dir` (and parents). Throws a Data error when `dir` exists and is
  // not empty, unless `overwrite`, which first removes the old index.json and
  // shards (other files are left alone).
  DatasetWriter(std::string dir, std::string tokenizer, int64_t vocab_size, int64_t eot_token,
                int64_t shard_tokens = int64_t(1) << 28, bool overwrite = false);
  ~DatasetWriter();  // without finish(): removes the shard in progress, writes no index
  DatasetWriter(const DatasetWriter&) = delete;
  DatasetWriter& operator=(const DatasetWriter&) = delete;

  // Appends one document. Validates every id first (a Data error names the
  // directory, the document and the position), so a rejected document leaves
  // the writer usable. An empty document is dropped.
  void add_document(const int32_t* ids, size_t n);
  // Closes the last shard and writes index.json; returns what it wrote.
  const DatasetIndex& finish();

  int64_t documents() const { return documents_; }
  int64_t tokens() const { return index_.total_tokens; }
  const std::string& dir() const { return dir_; }

 private:
  void open_shard();
  void close_shard();
  void write_tokens(const int32_t* ids, size_t n);

  std::string dir_;
  DatasetIndex index_;
  int64_t shard_tokens_;
  int64_t documents_ = 0;
  bool finished_ = false;
  // The shard in progress; doc_starts_ are offsets within it.
  std::FILE* file_ = nullptr;
  std::string tmp_path_;
  ShardInfo current_;
  std::vector<uint64_t> doc_starts_;
  std::vector<unsigned char> buf_;
};

// A validated, memory-mapped, read-only split. Move-only; unmaps on destruction.
class TokenDataset {
 public:
  // Reads and validates index.json and every shard header and document table
  // against the index and the file sizes. Token checksums are not read here
  // (that touches every byte); call verify_checksums() for that.
  static TokenDataset open(const std::string& dir);

  TokenDataset(TokenDataset&&) noexcept;
  TokenDataset& operator=(TokenDataset&&) noexcept;
  ~TokenDataset();

  int64_t num_tokens() const { return index_.total_tokens; }
  int64_t num_documents() const { return shard_doc_starts_.empty() ? 0 : shard_doc_starts_.back(); }
  const DatasetIndex& index() const { return index_; }
  const std::string& dir() const { return dir_; }

  // Copies tokens [begin, begin + count) (global positions) into out as int32.
  // Throws a Data error when the range is outside [0, num_tokens()).
  void read(int64_t begin, int64_t count, int32_t* out) const;
  // Global token range [begin, end) of document i.
  std::pair<int64_t, int64_t> document_span(int64_t i) const;
  // Recomputes every shard's checksum; throws a Data error naming the first
  // bad shard. `progress`, when set, is called after each shard with the
  // token bytes checked so far and in all.
  void verify_checksums(const std::function<void(int64_t done, int64_t total)>& progress = {}) const;

  struct Shard;  // one mapped shard, defined in dataset.cc

 private:
  friend std::vector<double> unigram_counts(const TokenDataset& ds);
  TokenDataset() = default;
  int64_t document_begin(int64_t i) const;

  std::string dir_;
  DatasetIndex index_;
  std::vector<Shard> shards_;
  std::vector<int64_t> shard_starts_;      // (n_shards + 1): global position of each shard's first token
  std::vector<int64_t> shard_doc_starts_;  // (n_shards + 1): index of the first document starting in each shard
};

// Occurrences of each id in the dataset, (vocab_size).
std::vector<double> unigram_counts(const TokenDataset& ds);
// Cross-entropy in nats per token of `val` under a unigram model of `train`
// with add-one (Laplace) smoothing over vocab_size: p(t) = (c_t + 1) / (N + V).
// The loss a model must beat to have learned more than token frequencies.
double unigram_cross_entropy(const TokenDataset& train, const TokenDataset& val);

}  // namespace xirang
