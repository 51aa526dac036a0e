// Fuzz target: GPT-2 byte-level BPE (runtime/data/bpe.h) on arbitrary bytes.
// Encoding any bytes (invalid UTF-8 included) and decoding the ids gives
// the bytes back; the same bytes read as int32 ids decode or are refused
// with xirang::Error (ids outside the vocabulary). Needs the vocabulary
// (tools/setup.sh; XIRANG_BPE_VOCAB_DIR): without it the target exits 77,
// which ctest reports as skipped, or 1 under XIRANG_REQUIRE_VOCAB=1.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "runtime/data/bpe.h"
#include "tests/fuzz/fuzz_util.h"

namespace {
std::unique_ptr<xirang::Gpt2Tokenizer> tokenizer;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string dir = xirang::Gpt2Tokenizer::default_vocab_dir();
  if (!std::filesystem::exists(dir + "/encoder.json") || !std::filesystem::exists(dir + "/vocab.bpe")) {
    const char* required = std::getenv("XIRANG_REQUIRE_VOCAB");
    const bool fail = required && std::string(required) == "1";
    std::fprintf(stderr, "fuzz_bpe: %s: no GPT-2 vocabulary in %s (tools/setup.sh installs it)\n",
                 fail ? "failed (XIRANG_REQUIRE_VOCAB=1)" : "skipped", dir.c_str());
    std::exit(fail ? 1 : 77);
  }
  tokenizer = xirang::Gpt2Tokenizer::load(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xirang;
  const std::string bytes = fuzz::text(data, size);
  fuzz::expect_errors([&] {
    const std::vector<int32_t> ids = tokenizer->encode(bytes);
    if (tokenizer->decode(ids.data(), ids.size()) != bytes) {
      std::fprintf(stderr, "fuzz_bpe: decode(encode(x)) != x for %zu bytes\n", size);
      std::abort();
    }
  });
  std::vector<int32_t> ids(size / 4);
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
  fuzz::expect_errors([&] { tokenizer->decode(ids.data(), ids.size()); });
  return 0;
}
