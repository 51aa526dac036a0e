// runtime/tokenizer.h: text <-> token ids, behind one interface.
//
// A Tokenizer is chosen by name, the same name a dataset's index.json records,
// so whoever reads a dataset can decode it with the tokenizer that wrote it.
// Today there is only "bytes" (id = byte value); GPT-2 byte-level BPE ("gpt2")
// will plug in behind the same interface.
//
//   std::unique_ptr<Tokenizer> tok = make_tokenizer("bytes");
//   std::vector<int32_t> ids = tok->encode("hello");      // {104, 101, 108, 108, 111}
//   std::string text = tok->decode(ids.data(), ids.size());
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace xirang {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;    // what index.json records, e.g. "bytes"
  virtual int64_t vocab_size() const = 0;  // ids are in [0, vocab_size)
  // The end-of-text id that separates documents, or -1 when the tokenizer has none.
  virtual int32_t eot_token() const = 0;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Throws a Data error when an id is outside [0, vocab_size).
  virtual std::string decode(const int32_t* ids, size_t n) const = 0;
};

// Every byte is its own token: no vocabulary files, lossless on any input.
class ByteTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "bytes"; }
  int64_t vocab_size() const override { return 256; }
  int32_t eot_token() const override { return -1; }
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const int32_t* ids, size_t n) const override;
};

// The tokenizer called `name`; throws a Config error for a name it does not know.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name);

}  // namespace xirang
