// Token dataset format: round trips, the uint32 path, and one clear
// single-line Data error per kind of damage.
#include "runtime/data/dataset.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/data/tokenizer.h"

#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& tag = "data") { return testing_util::fresh_test_dir(tag); }

using Docs = std::vector<std::vector<int32_t>>;

// Random documents with ids in [1, vocab): never all zeros, lengths 1..max_len.
Docs random_docs(std::mt19937_64& rng, int n, int max_len, int64_t vocab) {
  std::uniform_int_distribution<int> len(1, max_len);
  std::uniform_int_distribution<int64_t> id(1, vocab - 1);
  Docs docs(n);
  for (auto& d : docs) {
    d.resize(len(rng));
    for (auto& t : d) t = int32_t(id(rng));
  }
  return docs;
}

std::vector<int32_t> write_docs(const std::string& dir, const Docs& docs, int64_t vocab, int64_t shard_tokens) {
  DatasetWriter w(dir, "bytes", vocab, -1, shard_tokens);
  std::vector<int32_t> all;
  for (const auto& d : docs) {
    w.add_document(d.data(), d.size());
    all.insert(all.end(), d.begin(), d.end());
  }
  w.finish();
  return all;
}

// Runs f, expects a Data error on one line that mentions `needle`.
template <class F>
void expect_data_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected a data error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Data) << e.what();
    std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "message '" << msg << "' does not mention '" << needle << "'";
  }
}

void patch_file(const std::string& path, size_t offset, const void* bytes, size_t n) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(std::streamoff(offset));
  f.write(static_cast<const char*>(bytes), std::streamsize(n));
}

class DatasetRoundTrip : public ::testing::TestWithParam<int64_t> {};

// Shards of 97 tokens hold a few documents each; shards of 13 mostly hold
// only the middle of a document, so document starts skip whole shards.
INSTANTIATE_TEST_SUITE_P(DatasetShardSizes, DatasetRoundTrip, ::testing::Values(97, 13));

TEST_P(DatasetRoundTrip, ReadsAcrossShardBoundariesMatchWhatWasWritten) {
  const int64_t shard_tokens = GetParam();
  std::mt19937_64 rng(11);
  const std::string dir = fresh_dir("rt" + std::to_string(shard_tokens));
  Docs docs = random_docs(rng, 40, 90, 1000);
  std::vector<int32_t> all = write_docs(dir, docs, 1000, shard_tokens);

  TokenDataset ds = TokenDataset::open(dir);
  EXPECT_EQ(ds.num_tokens(), int64_t(all.size()));
  EXPECT_EQ(ds.num_documents(), int64_t(docs.size()));
  EXPECT_EQ(ds.index().token_dtype, DType::U16);
  EXPECT_EQ(ds.index().tokenizer, "bytes");
  EXPECT_EQ(int64_t(ds.index().shards.size()), (int64_t(all.size()) + shard_tokens - 1) / shard_tokens);
  EXPECT_GT(ds.index().shards.size(), 3u);
  if (shard_tokens < 20) {
    EXPECT_TRUE(std::any_of(ds.index().shards.begin(), ds.index().shards.end(),
                            [](const ShardInfo& s) { return s.documents == 0; }));
  }
  ds.verify_checksums();

  std::vector<int32_t> out(all.size());
  ds.read(0, ds.num_tokens(), out.data());
  EXPECT_EQ(out, all);
  std::uniform_int_distribution<int64_t> pos(0, ds.num_tokens());
  for (int k = 0; k < 200; ++k) {
    int64_t a = pos(rng), b = pos(rng);
    if (a > b) std::swap(a, b);
    std::vector<int32_t> part(size_t(b - a));
    ds.read(a, b - a, part.data());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin() + a)) << "[" << a << ", " << b << ")";
  }
  int64_t begin = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    auto [b, e] = ds.document_span(int64_t(i));
    EXPECT_EQ(b, begin);
    EXPECT_EQ(e - b, int64_t(docs[i].size()));
    begin = e;
  }
  // Moving keeps the mappings valid.
  TokenDataset moved = std::move(ds);
  std::vector<int32_t> tail(5);
  moved.read(moved.num_tokens() - 5, 5, tail.data());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), all.end() - 5));
  expect_data_error([&] { moved.read(moved.num_tokens() - 2, 3, tail.data()); }, dir);
  expect_data_error([&] { moved.read(-1, 1, tail.data()); }, dir);
}

TEST(Dataset, Uint32TokensForLargeVocab) {
  std::mt19937_64 rng(12);
  const std::string dir = fresh_dir("u32");
  const int64_t vocab = 100000;
  Docs docs = random_docs(rng, 10, 50, vocab);
  docs[0][0] = int32_t(vocab - 1);
  std::vector<int32_t> all = write_docs(dir, docs, vocab, 64);

  TokenDataset ds = TokenDataset::open(dir);
  EXPECT_EQ(ds.index().token_dtype, DType::U32);
  const ShardInfo& s0 = ds.index().shards[0];
  EXPECT_EQ(fs::file_size(fs::path(dir) / s0.file),
            uint64_t(kShardHeaderBytes + 4 * s0.tokens + 8 * (s0.documents + 1)));
  std::vector<int32_t> out(all.size());
  ds.read(0, ds.num_tokens(), out.data());
  EXPECT_EQ(out, all);
  ds.verify_checksums();
}

TEST(Dataset, EmptyDocumentsAreDroppedAndEmptyDatasetOpens) {
  const std::string dir = fresh_dir("empty");
  DatasetWriter w(dir, "bytes", 256, -1, 8);
  w.add_document(nullptr, 0);
  w.finish();
  TokenDataset ds = TokenDataset::open(dir);
  EXPECT_EQ(ds.num_tokens(), 0);
  EXPECT_EQ(ds.num_documents(), 0);
  EXPECT_TRUE(ds.index().shards.empty());
}

TEST(Dataset, RefusesNonEmptyDirectoryUnlessOverwrite) {
  std::mt19937_64 rng(13);
  const std::string dir = fresh_dir("ow");
  write_docs(dir, random_docs(rng, 20, 60, 256), 256, 50);
  const size_t old_shards = TokenDataset::open(dir).index().shards.size();
  expect_data_error([&] { DatasetWriter w(dir, "bytes", 256, -1, 50); }, dir);
  // The refusal touched nothing.
  EXPECT_EQ(TokenDataset::open(dir).index().shards.size(), old_shards);

  Docs fresh = random_docs(rng, 2, 10, 256);
  DatasetWriter w(dir, "bytes", 256, -1, 50, /*overwrite=*/true);
  std::vector<int32_t> all;
  for (const auto& d : fresh) {
    w.add_document(d.data(), d.size());
    all.insert(all.end(), d.begin(), d.end());
  }
  w.finish();
  TokenDataset ds = TokenDataset::open(dir);
  std::vector<int32_t> out(all.size());
  ds.read(0, ds.num_tokens(), out.data());
  EXPECT_EQ(out, all);
  // No stale shard of the old dataset is left behind.
  size_t bins = 0;
  for (const auto& e : fs::directory_iterator(dir)) bins += e.path().extension() == ".bin";
  EXPECT_EQ(bins, ds.index().shards.size());
}

TEST(Dataset, AbandonedWriterLeavesNoShardOrIndex) {
  const std::string dir = fresh_dir("abandon");
  {
    DatasetWriter w(dir, "bytes", 256, -1, 1000);
    std::vector<int32_t> d(100, 65);
    w.add_document(d.data(), d.size());
  }
  EXPECT_TRUE(fs::is_empty(dir));
  expect_data_error([&] { TokenDataset::open(dir); }, "index.json");
}

TEST(Dataset, RejectsTokenOutsideVocabAtWrite) {
  const std::string dir = fresh_dir("vocab");
  DatasetWriter w(dir, "bytes", 256, -1, 100);
  std::vector<int32_t> good = {1, 2, 3}, bad = {7, 256, 9};
  w.add_document(good.data(), good.size());
  expect_data_error([&] { w.add_document(bad.data(), bad.size()); }, dir);
  std::vector<int32_t> negative = {-3};
  expect_data_error([&] { w.add_document(negative.data(), negative.size()); }, dir);
  // The writer is still usable and the rejected documents left no trace.
  w.add_document(good.data(), good.size());
  w.finish();
  EXPECT_EQ(TokenDataset::open(dir).num_tokens(), 6);
}

class DatasetCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(14);
    dir_ = fresh_dir("corrupt");
    write_docs(dir_, random_docs(rng, 12, 40, 256), 256, 100);
    shard_ = (fs::path(dir_) / "shard_00000.bin").string();
    ASSERT_TRUE(fs::exists(shard_));
  }
  std::string dir_, shard_;
};

TEST_F(DatasetCorruption, TruncatedShard) {
  fs::resize_file(shard_, fs::file_size(shard_) - 7);
  expect_data_error([&] { TokenDataset::open(dir_); }, "shard '" + shard_ + "' is truncated");
  fs::resize_file(shard_, 20);
  expect_data_error([&] { TokenDataset::open(dir_); }, "shard '" + shard_ + "' is truncated");
}

TEST_F(DatasetCorruption, TrailingBytes) {
  std::ofstream(shard_, std::ios::app | std::ios::binary) << "xx";
  expect_data_error([&] { TokenDataset::open(dir_); }, shard_);
}

TEST_F(DatasetCorruption, BadMagic) {
  patch_file(shard_, 0, "GARBAGE!", 8);
  expect_data_error([&] { TokenDataset::open(dir_); }, "shard '" + shard_ + "' has bad magic");
}

TEST_F(DatasetCorruption, FlippedTokenByteFailsChecksum) {
  unsigned char b;
  {
    std::ifstream f(shard_, std::ios::binary);
    f.seekg(kShardHeaderBytes + 10);
    f.read(reinterpret_cast<char*>(&b), 1);
  }
  b ^= 0x01;
  patch_file(shard_, kShardHeaderBytes + 10, &b, 1);
  TokenDataset ds = TokenDataset::open(dir_);  // headers are still consistent
  expect_data_error([&] { ds.verify_checksums(); }, "shard '" + shard_ + "' is corrupt: checksum mismatch");
}

// Every shard is checked, not just the first: a flipped byte in the last
// one is named, after the shards before it were hashed.
TEST_F(DatasetCorruption, FlippedTokenByteInALaterShardFailsChecksum) {
  const size_t shards = TokenDataset::open(dir_).index().shards.size();
  ASSERT_GE(shards, 3u);
  char name[32];
  std::snprintf(name, sizeof name, "shard_%05zu.bin", shards - 1);
  const std::string last = (fs::path(dir_) / name).string();
  ASSERT_TRUE(fs::exists(last)) << last;
  unsigned char b;
  {
    std::ifstream f(last, std::ios::binary);
    f.seekg(kShardHeaderBytes + 1);
    f.read(reinterpret_cast<char*>(&b), 1);
  }
  b ^= 0x40;
  patch_file(last, kShardHeaderBytes + 1, &b, 1);
  TokenDataset ds = TokenDataset::open(dir_);
  int64_t hashed = 0, total = 0;
  expect_data_error([&] { ds.verify_checksums([&](int64_t done, int64_t all) { hashed = done, total = all; }); },
                    "shard '" + last + "' is corrupt: checksum mismatch");
  EXPECT_GT(hashed, 0);  // the shards before it passed
  EXPECT_LT(hashed, total);
}

TEST_F(DatasetCorruption, OutOfVocabTokenInShardFailsRead) {
  uint16_t big = 300;
  patch_file(shard_, kShardHeaderBytes + 2 * 5, &big, 2);
  TokenDataset ds = TokenDataset::open(dir_);
  std::vector<int32_t> out(10);
  expect_data_error([&] { ds.read(0, 10, out.data()); }, shard_);
  expect_data_error([&] { unigram_counts(ds); }, shard_);
}

TEST_F(DatasetCorruption, MissingIndex) {
  fs::remove(fs::path(dir_) / "index.json");
  expect_data_error([&] { TokenDataset::open(dir_); },
                    "no dataset at '" + dir_ + "' (missing " + dir_ + "/index.json)");
  expect_data_error([&] { TokenDataset::open(dir_ + "/nowhere"); }, "nowhere");
}

TEST_F(DatasetCorruption, MissingShard) {
  fs::remove(shard_);
  expect_data_error([&] { TokenDataset::open(dir_); }, "shard '" + shard_ + "' listed in");
}

TEST_F(DatasetCorruption, MalformedIndex) {
  const std::string index = dir_ + "/index.json";
  std::ofstream(index, std::ios::trunc) << "{\"format\": \"xirang-tokens\",\n \"version\": 1,\n";
  expect_data_error([&] { TokenDataset::open(dir_); }, "index '" + index + "' is not valid JSON");
  std::ofstream(index, std::ios::trunc) << R"({"format": "xirang-tokens", "version": 1, "tokenizer": "bytes",
    "vocab_size": "many", "token_dtype": "uint16", "eot_token": -1, "total_tokens": 0, "shards": []})";
  expect_data_error([&] { TokenDataset::open(dir_); }, "'vocab_size'");
  std::ofstream(index, std::ios::trunc) << R"({"format": "xirang-tokens", "version": 1, "tokenizer": "bytes",
    "vocab_size": 256, "token_dtype": "uint16", "eot_token": -1, "total_tokens": 5,
    "shards": [{"file": "../x.bin", "tokens": 5, "documents": 1, "checksum": "0000000000000000"}]})";
  expect_data_error([&] { TokenDataset::open(dir_); }, "'../x.bin'");
}

TEST_F(DatasetCorruption, IndexDisagreesWithShard) {
  const std::string index = dir_ + "/index.json";
  std::ifstream in(index);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  size_t p = text.find("\"tokens\": 100");
  ASSERT_NE(p, std::string::npos) << text;
  text.replace(p, 13, "\"tokens\": 101");
  size_t q = text.find("\"total_tokens\": ");
  int64_t total = std::stoll(text.substr(q + 16));
  text.replace(q + 16, std::to_string(total).size(), std::to_string(total + 1));
  std::ofstream(index, std::ios::trunc) << text;
  expect_data_error([&] { TokenDataset::open(dir_); }, shard_);
}

TEST(Unigram, CrossEntropyMatchesHandComputedValue) {
  const std::string train_dir = fresh_dir("train"), val_dir = fresh_dir("val");
  {
    DatasetWriter w(train_dir, "bytes", 4, -1, 3);
    std::vector<int32_t> a = {0, 1}, b = {2, 0, 2, 2};
    w.add_document(a.data(), a.size());
    w.add_document(b.data(), b.size());
    w.finish();
    DatasetWriter v(val_dir, "bytes", 4, -1);
    std::vector<int32_t> c = {2, 3, 0};
    v.add_document(c.data(), c.size());
    v.finish();
  }
  TokenDataset train = TokenDataset::open(train_dir), val = TokenDataset::open(val_dir);
  EXPECT_EQ(unigram_counts(train), (std::vector<double>{2, 1, 3, 0}));
  // Laplace: p = (c + 1) / (6 + 4) = {0.3, 0.2, 0.4, 0.1}; val = {2, 3, 0}.
  double expected = -(std::log(0.4) + std::log(0.1) + std::log(0.3)) / 3.0;
  EXPECT_NEAR(unigram_cross_entropy(train, val), expected, 1e-12);

  const std::string other = fresh_dir("other");
  DatasetWriter w(other, "bytes", 8, -1);
  std::vector<int32_t> d = {5};
  w.add_document(d.data(), d.size());
  w.finish();
  expect_data_error([&] { unigram_cross_entropy(train, TokenDataset::open(other)); }, other);
}

TEST(Tokenizer, BytesRoundTripOnRandomBytes) {
  std::mt19937_64 rng(15);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string text(4096, '\0');
  for (char& c : text) c = char(byte(rng));
  auto tok = make_tokenizer("bytes");
  EXPECT_EQ(tok->name(), "bytes");
  EXPECT_EQ(tok->vocab_size(), 256);
  EXPECT_EQ(tok->eot_token(), -1);
  std::vector<int32_t> ids = tok->encode(text);
  ASSERT_EQ(ids.size(), text.size());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], int32_t(static_cast<unsigned char>(text[i])));
  EXPECT_EQ(tok->decode(ids.data(), ids.size()), text);
  std::vector<int32_t> bad = {65, 256};
  EXPECT_THROW(tok->decode(bad.data(), bad.size()), Error);
}

TEST(Tokenizer, UnknownNameIsAConfigError) {
  try {
    make_tokenizer("sentencepiece");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("expected bytes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace xirang
