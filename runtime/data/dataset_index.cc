// index.json of a dataset split: written by DatasetWriter::finish(), parsed
// and validated by TokenDataset::open().
#include "runtime/data/dataset_index.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace xirang {

namespace {

// Messages must stay one line even when they quote file contents or library text.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

const nlohmann::json& field(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) fail(ErrorKind::Data, where, ": field '", key, "' is missing");
  return *it;
}

int64_t int_field(const nlohmann::json& j, const char* key, const std::string& where) {
  const nlohmann::json& v = field(j, key, where);
  if (!v.is_number_integer())
    fail(ErrorKind::Data, where, ": field '", key, "' is ", one_line(v.dump()), " (expected an integer)");
  return v.get<int64_t>();
}

std::string string_field(const nlohmann::json& j, const char* key, const std::string& where) {
  const nlohmann::json& v = field(j, key, where);
  if (!v.is_string())
    fail(ErrorKind::Data, where, ": field '", key, "' is ", one_line(v.dump()), " (expected a string)");
  return v.get<std::string>();
}

// The JSON value of the index, or a Data error quoting the parser's message
// without nlohmann's "[json.exception...] " prefix.
nlohmann::json parse_json(const std::string& text, const std::string& path) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    std::string msg = e.what();
    if (size_t p = msg.find("] "); msg.rfind("[json.exception", 0) == 0 && p != std::string::npos)
      msg = msg.substr(p + 2);
    fail(ErrorKind::Data, "index '", path, "' is not valid JSON: ", one_line(msg));
  }
}

// Every field but "shards", each checked against the format's rules.
DatasetIndex parse_index_fields(const nlohmann::json& j, const std::string& where) {
  DatasetIndex ix;
  ix.format = string_field(j, "format", where);
  if (ix.format != kDatasetFormat)
    fail(ErrorKind::Data, where, " has format '", ix.format, "' (expected ", kDatasetFormat, ")");
  ix.version = int(int_field(j, "version", where));
  if (ix.version != int(kDatasetVersion))
    fail(ErrorKind::Data, where, " has version ", ix.version, " (this build reads version ", kDatasetVersion, ")");
  ix.tokenizer = string_field(j, "tokenizer", where);
  ix.vocab_size = int_field(j, "vocab_size", where);
  if (ix.vocab_size < 1 || ix.vocab_size > (int64_t(1) << 32))
    fail(ErrorKind::Data, where, ": vocab_size ", ix.vocab_size, " is out of range (expected 1..4294967296)");
  std::string dt = string_field(j, "token_dtype", where);
  if (dt == "uint16") ix.token_dtype = DType::U16;
  else if (dt == "uint32") ix.token_dtype = DType::U32;
  else fail(ErrorKind::Data, where, ": token_dtype '", dt, "' is not uint16 or uint32");
  if (ix.token_dtype == DType::U16 && ix.vocab_size > 65536)
    fail(ErrorKind::Data, where, ": token_dtype uint16 cannot hold vocab_size ", ix.vocab_size);
  ix.eot_token = int_field(j, "eot_token", where);
  if (ix.eot_token < -1 || ix.eot_token >= ix.vocab_size)
    fail(ErrorKind::Data, where, ": eot_token ", ix.eot_token, " is outside [-1, ", ix.vocab_size, ")");
  ix.total_tokens = int_field(j, "total_tokens", where);
  return ix;
}

// One element of "shards"; `w` names it in error messages.
ShardInfo parse_shard_info(const nlohmann::json& j, const std::string& w) {
  if (!j.is_object()) fail(ErrorKind::Data, w, " is not a JSON object");
  ShardInfo s;
  s.file = string_field(j, "file", w);
  // Shards live in the split directory; a path could read files elsewhere.
  if (s.file.empty() || s.file.find('/') != std::string::npos || s.file == "." || s.file == "..")
    fail(ErrorKind::Data, w, ": file '", s.file, "' is not a plain file name");
  s.tokens = int_field(j, "tokens", w);
  s.documents = int_field(j, "documents", w);
  if (s.tokens < 0 || s.documents < 0 || s.documents > s.tokens)
    fail(ErrorKind::Data, w, ": ", s.tokens, " tokens and ", s.documents, " documents are inconsistent");
  std::string hex = string_field(j, "checksum", w);
  char* end = nullptr;
  s.checksum = std::strtoull(hex.c_str(), &end, 16);
  if (hex.size() != 16 || end != hex.c_str() + 16)
    fail(ErrorKind::Data, w, ": checksum '", hex, "' is not 16 hex digits");
  return s;
}

}  // namespace

std::string checksum_hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string index_json_text(const DatasetIndex& index) {
  nlohmann::ordered_json j;
  j["format"] = index.format;
  j["version"] = index.version;
  j["tokenizer"] = index.tokenizer;
  j["vocab_size"] = index.vocab_size;
  j["token_dtype"] = index.token_dtype == DType::U32 ? "uint32" : "uint16";
  j["eot_token"] = index.eot_token;
  j["total_tokens"] = index.total_tokens;
  j["shards"] = nlohmann::ordered_json::array();
  for (const ShardInfo& s : index.shards)
    j["shards"].push_back({{"file", s.file}, {"tokens", s.tokens}, {"documents", s.documents},
                           {"checksum", checksum_hex(s.checksum)}});
  return j.dump(2) + "\n";
}

DatasetIndex parse_index(const std::string& text, const std::string& path) {
  const nlohmann::json j = parse_json(text, path);
  const std::string where = str_cat("index '", path, "'");
  if (!j.is_object()) fail(ErrorKind::Data, where, " is not a JSON object");
  DatasetIndex ix = parse_index_fields(j, where);
  const nlohmann::json& shards = field(j, "shards", where);
  if (!shards.is_array()) fail(ErrorKind::Data, where, ": field 'shards' is not an array");
  int64_t sum = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    ix.shards.push_back(parse_shard_info(shards[i], str_cat(where, " shard ", i)));
    if (__builtin_add_overflow(sum, ix.shards.back().tokens, &sum))
      fail(ErrorKind::Data, where, ": its shards hold more than ", INT64_MAX, " tokens in all (shard ", i, " has ",
           ix.shards.back().tokens, ")");
  }
  if (sum != ix.total_tokens)
    fail(ErrorKind::Data, where, ": total_tokens is ", ix.total_tokens, " but its shards hold ", sum);
  return ix;
}

}  // namespace xirang
