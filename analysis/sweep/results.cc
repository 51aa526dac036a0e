// results.jsonl (one row per finished point, appended as it finishes) and
// results.csv (the same rows, flat, rewritten after every point).
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "analysis/sweep/sweep.h"

namespace xirang::analysis::sweep {

namespace fs = std::filesystem;

std::map<std::string, Json> read_results(const std::string& path) {
  std::map<std::string, Json> rows;
  std::ifstream in(path);
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    // A line cut short by a killed sweep is not a result: that point runs again.
    if (j.is_discarded() || !j.is_object() || !j.contains("id") || !j["id"].is_string() || !j.contains("status"))
      continue;
    const std::string id = j["id"].get<std::string>();
    rows[id] = std::move(j);
  }
  return rows;
}

void append_result(const std::string& path, const Json& row) {
  std::ofstream out(path, std::ios::app);
  out << row.dump() << '\n';
  out.flush();
  if (!out) fail(ErrorKind::Data, "sweep: cannot append to '", path, "'");
}

namespace {

// RFC 4180: a field with a comma, quote or line break is quoted, quotes doubled.
std::string csv_field(const Json& v) {
  std::string s;
  if (v.is_null()) return "";
  if (v.is_string()) s = v.get<std::string>();
  else if (v.is_boolean()) s = v.get<bool>() ? "true" : "false";
  else s = v.dump();
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

struct Column {
  std::string name;
  std::vector<std::string> path;  // where in the row
};

std::vector<Column> columns(const std::vector<Json>& rows) {
  std::vector<Column> cols;
  for (const char* k : {"point", "id", "ranks", "status", "reason"}) cols.push_back({k, {k}});
  std::vector<std::string> settings;
  for (const Json& r : rows)
    for (const auto& [k, v] : r["settings"].items())
      if (k != "ranks" && std::find(settings.begin(), settings.end(), k) == settings.end()) settings.push_back(k);
  for (const std::string& k : settings) cols.push_back({k, {"settings", k}});
  for (const char* k : {"dp", "cp", "tp", "pp", "virtual_stages", "schedule", "zero", "sequence_parallel", "micro_batch",
                        "global_batch"})
    cols.push_back({k, {"layout", k}});
  for (const char* k : {"n_layer", "d_model", "n_head", "seq_len", "vocab_size"}) cols.push_back({k, {"model", k}});
  for (const char* k : {"precision", "repeats", "steps_measured", "step_ms_median", "step_ms_p10", "step_ms_p90",
                        "tokens_per_s", "mfu"})
    cols.push_back({k, {k}});
  for (const std::string& k : breakdown_keys()) cols.push_back({k, {"breakdown_ms", k}});
  for (const std::string& k : breakdown_keys()) {
    const std::string s = k.substr(0, k.size() - 3);
    cols.push_back({"share_" + s, {"shares", s}});
  }
  cols.push_back({"memory_bytes_per_rank", {"memory_bytes_per_rank"}});
  return cols;
}

Json at(const Json& row, const std::vector<std::string>& path) {
  const Json* j = &row;
  for (const std::string& k : path) {
    if (!j->is_object() || !j->contains(k)) return nullptr;
    j = &(*j)[k];
  }
  return *j;
}

}  // namespace

void write_csv(const std::vector<Json>& rows, const std::string& path) {
  const std::vector<Column> cols = columns(rows);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    for (size_t c = 0; c < cols.size(); ++c) out << (c ? "," : "") << cols[c].name;
    out << '\n';
    for (const Json& r : rows) {
      for (size_t c = 0; c < cols.size(); ++c) out << (c ? "," : "") << csv_field(at(r, cols[c].path));
      out << '\n';
    }
    if (!out) fail(ErrorKind::Data, "sweep: cannot write '", tmp, "'");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail(ErrorKind::Data, "sweep: cannot write '", path, "': ", ec.message());
}

}  // namespace xirang::analysis::sweep
