// runtime/data/tokenizer.h: text <-> token ids, behind one interface.
//
// A Tokenizer is chosen by name, the same name a dataset's index.json records,
// so whoever reads a dataset can decode it with the tokenizer that wrote it.
// Two exist: "bytes" (id = byte value) and "gpt2" (GPT-2's byte-level BPE,
// runtime/data/bpe.h, whose vocabulary files tools/setup.sh installs).
//
//   std::unique_ptr<Tokenizer> tok = make_tokenizer("bytes");
//   std::vector<int32_t> ids = tok->encode("hello");      // {104, 101, 108, 108, 111}
//   std::string text = tok->decode(ids.data(), ids.size());
//   auto all = encode_parallel(*tok, {doc_a, doc_b}, /*threads=*/8);  // all[i] == tok->encode(doc_i)
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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
  // Safe to call from several threads at once on one tokenizer.
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

// The tokenizer called `name` ("bytes" or "gpt2"); throws a Config error for a
// name it does not know. "gpt2" loads its vocabulary from
// Gpt2Tokenizer::default_vocab_dir() ($XIRANG_BPE_VOCAB_DIR, else the copy
// tools/setup.sh installs in the source tree) and throws a Data error naming
// the missing file when it is absent.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name);

// Where a text may be cut so that encoding the pieces and concatenating the
// ids equals encoding the whole, for both tokenizers: the first p >= target
// such that text[p-1] is printable ASCII other than space and text[p] is ' '
// or '\n'. GPT-2's regex never matches across such a p (the word before it
// cannot take whitespace at its end) and never looks past it, and matching
// after p does not depend on what came before. text.size() when there is none.
size_t next_safe_cut(std::string_view text, size_t target);

// Encodes texts[i] into result[i] (equal to tok.encode(texts[i])) on
// `threads` threads. Texts longer than `piece_bytes` are cut at
// next_safe_cut, so one long document also keeps every thread busy.
// `progress(bytes_done)` is called from the calling thread every
// ~100 ms and once at the end.
std::vector<std::vector<int32_t>> encode_parallel(const Tokenizer& tok, const std::vector<std::string_view>& texts,
                                                  int threads, const std::function<void(size_t)>& progress = {},
                                                  size_t piece_bytes = size_t(1) << 20);

}  // namespace xirang
