// GPT-2 BPE (runtime/data/bpe.h) and the parallel encoding helpers
// (runtime/data/tokenizer.h). The golden ids come from gpt-3-encoder@1.1.4 (node);
// tests/cli/tokenizer_test.sh compares whole texts with it token by token.
#include "runtime/data/bpe.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "runtime/data/tokenizer.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

// The tokenizer, or nullptr when the vocabulary is not installed (the caller skips).
std::unique_ptr<Gpt2Tokenizer> load_or_null() {
  const std::string dir = Gpt2Tokenizer::default_vocab_dir();
  if (!fs::exists(fs::path(dir) / "encoder.json") || !fs::exists(fs::path(dir) / "vocab.bpe")) return nullptr;
  return Gpt2Tokenizer::load(dir);
}

// Whether a missing vocabulary fails the test instead of skipping it:
// XIRANG_REQUIRE_VOCAB=1, which tools/run_tests.sh sets after tools/setup.sh
// installed it, so that a broken install cannot hide these tests.
bool vocab_required() {
  const char* v = std::getenv("XIRANG_REQUIRE_VOCAB");
  return v && std::string(v) == "1";
}

#define LOAD_GPT2_OR_SKIP(tok)                                                                            \
  std::unique_ptr<Gpt2Tokenizer> tok = load_or_null();                                                    \
  if (!tok && vocab_required())                                                                           \
    FAIL() << "GPT-2 vocabulary not installed in " << Gpt2Tokenizer::default_vocab_dir()                  \
           << " and XIRANG_REQUIRE_VOCAB=1 (tools/setup.sh installs it)";                                  \
  if (!tok)                                                                                               \
  GTEST_SKIP() << "GPT-2 vocabulary not installed in " << Gpt2Tokenizer::default_vocab_dir()              \
               << " (tools/setup.sh installs it)"

std::string read_asset(const std::string& name) {
  std::ifstream f(std::string(XIRANG_SOURCE_DIR) + "/tests/assets/tokenizer/" + name, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string all_assets() {
  std::string text;
  for (const char* name : {"english.txt", "whitespace.txt", "multilingual.txt", "code.txt", "emoji.txt"})
    text += read_asset(name);
  return text;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | cp >> 6), s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | cp >> 12), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | cp >> 18), s += char(0x80 | ((cp >> 12) & 0x3F)), s += char(0x80 | ((cp >> 6) & 0x3F)),
        s += char(0x80 | (cp & 0x3F));
  }
}

// Random text drawn from blocks that exercise every branch of the regex:
// ASCII, whitespace of several kinds, Latin-1, combining marks, CJK, emoji
// and other astral characters, digits of other scripts.
std::string random_unicode(std::mt19937_64& rng, size_t n_chars) {
  static const std::vector<std::pair<uint32_t, uint32_t>> blocks = {
      {0x20, 0x7E},       {0x20, 0x20},       {0x09, 0x0D},       {0xA0, 0xFF},       {0x300, 0x36F},
      {0x400, 0x4FF},     {0x600, 0x6FF},     {0x900, 0x97F},     {0x2000, 0x206F},   {0x3000, 0x303F},
      {0x4E00, 0x9FFF},   {0xFEFF, 0xFEFF},   {0xFF00, 0xFFEF},   {0x1D400, 0x1D7FF}, {0x1F300, 0x1FAFF},
      {0x20000, 0x2A6DF}, {0x31350, 0x323AF}, {0x0027, 0x0027},   {0x0085, 0x0085},   {0xE000, 0xE0FF}};
  std::uniform_int_distribution<size_t> pick(0, blocks.size() - 1);
  std::string s;
  for (size_t i = 0; i < n_chars; ++i) {
    const auto [lo, hi] = blocks[pick(rng)];
    append_utf8(s, std::uniform_int_distribution<uint32_t>(lo, hi)(rng));
  }
  return s;
}

TEST(Gpt2Tokenizer, KnownEncodings) {
  LOAD_GPT2_OR_SKIP(tok);
  EXPECT_EQ(tok->name(), "gpt2");
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eot_token(), 50256);
  EXPECT_EQ(tok->encode("Hello world"), (Ids{15496, 995}));
  EXPECT_EQ(tok->encode(" hello"), (Ids{23748}));
  EXPECT_EQ(tok->encode(""), Ids{});
  // "\n\n" before a word is two tokens: \s+(?!\S) backs off one character.
  EXPECT_EQ(tok->encode("Hello\n\nWorld"), (Ids{15496, 198, 198, 10603}));
  EXPECT_EQ(tok->encode("I'm sure they'll say we'd've done it. DON'T"),
            (Ids{40, 1101, 1654, 484, 1183, 910, 356, 1549, 1053, 1760, 340, 13, 23917, 6, 51}));
  EXPECT_EQ(tok->encode("  x\t\ty"), (Ids{220, 2124, 197, 197, 88}));
  EXPECT_EQ(tok->encode("1234567 3.14"), (Ids{10163, 2231, 3134, 513, 13, 1415}));
  EXPECT_EQ(tok->encode("你好，世界"), (Ids{19526, 254, 25001, 121, 171, 120, 234, 10310, 244, 45911, 234}));
  EXPECT_EQ(tok->encode("😀👍🏽"), (Ids{47249, 222, 41840, 235, 8582, 237, 121}));
  EXPECT_EQ(tok->encode("def f(x):\n    return x**2\n"),
            (Ids{4299, 277, 7, 87, 2599, 198, 220, 220, 220, 1441, 2124, 1174, 17, 198}));
  // GPT-2 has no merge of two spaces: a run of spaces is one token each.
  Ids spaces(19, 220);
  spaces.push_back(2124);  // " x"
  EXPECT_EQ(tok->encode(std::string(20, ' ') + "x"), spaces);
}

TEST(Gpt2Tokenizer, EndOfTextIsTextWhenEncodedAndTheSeparatorWhenDecoded) {
  LOAD_GPT2_OR_SKIP(tok);
  // As in encoder.py and gpt-3-encoder: only the caller inserts eot_token(),
  // so a document that quotes the marker cannot split itself.
  EXPECT_EQ(tok->encode("<|endoftext|>"), (Ids{27, 91, 437, 1659, 5239, 91, 29}));
  const Ids eot = {15496, 50256, 995};
  EXPECT_EQ(tok->decode(eot.data(), eot.size()), "Hello<|endoftext|> world");
}

TEST(Gpt2Tokenizer, DecodeRejectsIdsOutsideTheVocabulary) {
  LOAD_GPT2_OR_SKIP(tok);
  for (int32_t bad : {-1, 50257, 1 << 30}) {
    const Ids ids = {15496, bad};
    try {
      tok->decode(ids.data(), ids.size());
      FAIL() << "expected an error for id " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Data);
      EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
    }
  }
}

TEST(Gpt2Tokenizer, RoundTripOnRandomUnicode) {
  LOAD_GPT2_OR_SKIP(tok);
  std::mt19937_64 rng(2019);
  for (int trial = 0; trial < 200; ++trial) {
    const std::string text = random_unicode(rng, 1 + size_t(rng() % 300));
    const Ids ids = tok->encode(text);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < 50256) << "id " << id;
    ASSERT_EQ(tok->decode(ids.data(), ids.size()), text) << "trial " << trial;
  }
}

TEST(Gpt2Tokenizer, RoundTripOnInvalidUtf8) {
  LOAD_GPT2_OR_SKIP(tok);
  // Stray continuation bytes, truncated sequences, overlongs, surrogates,
  // code points above U+10FFFF, and random bytes: raw bytes must survive.
  const std::vector<std::string> cases = {"\x80", "a\xff b", "\xc3", "caf\xc3", "\xe2\x82 x", "\xc0\xaf",
                                          "\xed\xa0\x80", "\xf4\x90\x80\x80", "ok \xf0\x9f\x98 \xf0\x9f\x98\x80!"};
  for (const std::string& text : cases) {
    const Ids ids = tok->encode(text);
    EXPECT_EQ(tok->decode(ids.data(), ids.size()), text);
  }
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::string text(1 + rng() % 500, '\0');
    for (char& c : text) c = char(rng() & 0xFF);
    const Ids ids = tok->encode(text);
    ASSERT_EQ(tok->decode(ids.data(), ids.size()), text) << "trial " << trial;
  }
  // An invalid byte groups with punctuation like U+FFFD would: "!" "\xff" "!" is one word.
  EXPECT_EQ(tok->encode("a!\xff!").size(), tok->encode("a").size() + tok->encode("!\xff!").size());
}

TEST(Gpt2Tokenizer, ConcurrentEncodingGivesTheSameIds) {
  LOAD_GPT2_OR_SKIP(tok);
  const std::string text = all_assets();
  const Ids expected = tok->encode(text);
  std::vector<Ids> got(8);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep) got[t] = tok->encode(text);
    });
  for (std::thread& t : threads) t.join();
  for (const Ids& ids : got) EXPECT_EQ(ids, expected);
}

TEST(Gpt2Tokenizer, WordCacheOverflowKeepsTheIds) {
  LOAD_GPT2_OR_SKIP(tok);
  // 400k distinct words overflow the word cache (64 shards of at most 4096
  // words), so each shard starts over; ids must not depend on what is cached.
  std::string text;
  for (uint32_t i = 0; i < 400000; ++i) {
    text += ' ';
    for (uint32_t v = i * 2654435761u; v; v /= 26) text += char('a' + v % 26);
  }
  const Ids first = tok->encode(text), second = tok->encode(text);
  EXPECT_EQ(first, second);
  EXPECT_EQ(tok->decode(second.data(), second.size()), text);
  // A word alone, with a cold or a warm cache, encodes as within the text.
  EXPECT_EQ(tok->encode(" banana"), (Ids{25996}));
}

TEST(Gpt2Tokenizer, MissingVocabularyNamesTheFileAndTheFix) {
  const std::string dir = (fs::temp_directory_path() / ("xirang_no_vocab_" + std::to_string(getpid()))).string();
  try {
    Gpt2Tokenizer::load(dir);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Data);
    const std::string msg = e.what();
    EXPECT_NE(msg.find(dir + "/encoder.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tools/setup.sh"), std::string::npos) << msg;
  }
}

TEST(Gpt2Tokenizer, MalformedVocabularyIsADataError) {
  const fs::path dir = fs::temp_directory_path() / ("xirang_bad_vocab_" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "encoder.json") << "{\"a\": 0, ";
  std::ofstream(dir / "vocab.bpe") << "#version: 0.2\n";
  try {
    Gpt2Tokenizer::load(dir.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Data);
    EXPECT_NE(std::string(e.what()).find("encoder.json"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(TokenizerParallel, SafeCutsSplitTheEncodingExactly) {
  LOAD_GPT2_OR_SKIP(tok);
  const std::string text = all_assets();
  const Ids whole = tok->encode(text);
  std::mt19937_64 rng(3);
  int cuts = 0;
  for (int trial = 0; trial < 100; ++trial) {
    const size_t p = next_safe_cut(text, size_t(rng() % text.size()));
    if (p == text.size()) continue;
    ++cuts;
    ASSERT_TRUE((text[p] == ' ' || text[p] == '\n') && text[p - 1] > ' ' && text[p - 1] < 0x7F);
    Ids joined = tok->encode(std::string_view(text).substr(0, p));
    const Ids rest = tok->encode(std::string_view(text).substr(p));
    joined.insert(joined.end(), rest.begin(), rest.end());
    ASSERT_EQ(joined, whole) << "cut at byte " << p;
  }
  EXPECT_GT(cuts, 50);
  EXPECT_EQ(next_safe_cut("no-cut-here", 0), 11u);
  EXPECT_EQ(next_safe_cut("a b", 0), 1u);
  EXPECT_EQ(next_safe_cut("  b", 0), 3u);  // whitespace before whitespace is not a cut
}

TEST(TokenizerParallel, EncodeParallelEqualsEncodeForAnyThreadCount) {
  std::vector<std::unique_ptr<Tokenizer>> toks;
  toks.push_back(make_tokenizer("bytes"));
  if (std::unique_ptr<Gpt2Tokenizer> gpt2 = load_or_null()) toks.push_back(std::move(gpt2));
  const std::string big = all_assets();
  const std::vector<std::string_view> texts = {big, "", "x", std::string_view(big).substr(100, 3000), "a b c"};
  for (const auto& tok : toks) {
    for (int threads : {1, 3, 8}) {
      // Small pieces force the long texts to be cut many times.
      const std::vector<Ids> got = encode_parallel(*tok, texts, threads, {}, 256);
      ASSERT_EQ(got.size(), texts.size());
      for (size_t i = 0; i < texts.size(); ++i)
        EXPECT_EQ(got[i], tok->encode(texts[i])) << tok->name() << ", text " << i << ", " << threads << " threads";
    }
  }
}

TEST(TokenizerParallel, ProgressReachesTheTotal) {
  auto tok = make_tokenizer("bytes");
  const std::string text(100000, 'a');
  size_t last = 0;
  encode_parallel(*tok, {text, text}, 2, [&](size_t done) { last = done; }, 4096);
  EXPECT_EQ(last, 2 * text.size());
}

}  // namespace
}  // namespace xirang
