#include "runtime/tokenizer.h"

#include "core/error.h"

namespace xirang {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const int32_t* ids, size_t n) const {
  std::string text(n, '\0');
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] > 255)
      fail(ErrorKind::Data, "bytes tokenizer: cannot decode token id ", ids[i], " at position ", i,
           " (expected 0..255)");
    text[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
  }
  return text;
}

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name) {
  if (name == "bytes") return std::make_unique<ByteTokenizer>();
  // "gpt2" joins here once its vocabulary files are part of the set-up.
  fail(ErrorKind::Config, "unknown tokenizer '", name, "' (expected bytes)");
}

}  // namespace xirang
