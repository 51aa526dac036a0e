// Fuzz target: a dataset shard file (runtime/data/dataset.h: the 64-byte
// header, the tokens and the document table), opened as TokenDataset::open()
// opens it for the data loader, then checked as `data.verify` checks it
// (verify_checksums), read token by token and document by document. The
// input is the shard; index.json is written to agree with whatever the
// header claims (counts, token width, vocabulary, checksum), so that the
// fuzzer reaches the reader's own checks of the file against itself rather
// than stopping at the index comparison. The same bytes are also the
// split's second shard, so reads cross a shard boundary. It must load or be
// refused with xirang::Error, and never read outside the file.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/data/dataset.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace fs = std::filesystem;
std::string split_dir;  // this process's scratch split directory

uint64_t get_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), std::streamsize(text.size()));
}

// index.json for one or two copies of the shard, agreeing with its header.
std::string index_for(const uint8_t* data, size_t size, int shards) {
  uint64_t vocab = 256, tokens = 0, docs = 0, checksum = 0;
  uint32_t width = 2;
  if (size >= xirang::kShardHeaderBytes) {
    width = get_u32(data + 12);
    vocab = get_u64(data + 16);
    tokens = get_u64(data + 24);
    docs = get_u64(data + 32);
    checksum = get_u64(data + 40);
  }
  // JSON integers the index parser takes; larger header values stay
  // disagreeing with the index, which the reader must refuse too.
  auto clamp = [](uint64_t v) { return std::to_string(std::min<uint64_t>(v, uint64_t(1) << 62)); };
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum));
  std::string shard_list;
  for (int s = 0; s < shards; ++s)
    shard_list += std::string(s ? ", " : "") + "{\"file\": \"shard_0000" + std::to_string(s) + ".bin\", \"tokens\": " +
                  clamp(tokens) + ", \"documents\": " + clamp(docs) + ", \"checksum\": \"" + hex + "\"}";
  const uint64_t total = std::min<uint64_t>(tokens, uint64_t(1) << 40) * uint64_t(shards);
  return std::string("{\"format\": \"xirang-tokens\", \"version\": 1, \"tokenizer\": \"bytes\", ") +
         "\"vocab_size\": " + clamp(vocab) + ", \"token_dtype\": \"" + (width == 4 ? "uint32" : "uint16") +
         "\", \"eot_token\": -1, \"total_tokens\": " + std::to_string(total) + ", \"shards\": [" + shard_list + "]}";
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const fs::path dir = fs::temp_directory_path() / ("xirang_fuzz_shard." + std::to_string(::getpid()));
  fs::create_directories(dir);
  split_dir = dir.string();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xirang;
  const std::string shard = fuzz::text(data, size);
  write_file(split_dir + "/shard_00000.bin", shard);
  write_file(split_dir + "/shard_00001.bin", shard);
  // Two shards when the header's checksum is odd (a valid file's checksum
  // is as likely odd as even).
  const int shards = size >= kShardHeaderBytes && (data[40] & 1) ? 2 : 1;
  write_file(split_dir + "/index.json", index_for(data, size, shards));
  fuzz::expect_errors([&] {
    // XIRANG_FUZZ_VERBOSE=1: say why an input is refused (to check that the seeds load).
    const TokenDataset ds = [&] {
      try {
        return TokenDataset::open(split_dir);
      } catch (const Error& e) {
        if (std::getenv("XIRANG_FUZZ_VERBOSE")) std::fprintf(stderr, "refused: %s\n", e.what());
        throw;
      }
    }();
    fuzz::expect_errors([&] { ds.verify_checksums(); });
    // Every token, in reads of a few sizes that start and end anywhere.
    std::vector<int32_t> buf(size_t(std::min<int64_t>(ds.num_tokens(), 4096)) + 1);
    for (int64_t chunk : {int64_t(1), int64_t(7), int64_t(4096)}) {
      fuzz::expect_errors([&] {
        for (int64_t b = 0; b < ds.num_tokens(); b += chunk)
          ds.read(b, std::min(chunk, ds.num_tokens() - b), buf.data());
      });
    }
    fuzz::expect_errors([&] { ds.read(ds.num_tokens(), 1, buf.data()); });  // one past the end: refused
    for (int64_t i = 0; i < ds.num_documents(); ++i) {
      const auto [b, e] = ds.document_span(i);
      if (b < 0 || b > e || e > ds.num_tokens()) {
        std::fprintf(stderr, "fuzz: document %lld spans [%lld, %lld) outside %lld tokens\n", (long long)i,
                     (long long)b, (long long)e, (long long)ds.num_tokens());
        std::abort();
      }
    }
    if (ds.index().vocab_size <= (int64_t(1) << 20)) fuzz::expect_errors([&] { (void)unigram_counts(ds); });
  });
  return 0;
}
