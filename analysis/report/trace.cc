// Reading, checking and merging metrics.trace's per-rank files.
#include "analysis/report/trace.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"

namespace xirang::analysis::report {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kRankFormat = "xirang-trace-1";
constexpr const char* kMergedFormat = "xirang-trace-merged-1";

json parse_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorKind::Data, "trace: cannot read '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    json j = json::parse(ss.str());
    if (!j.is_object()) fail(ErrorKind::Data, "trace: ", path, " is not a JSON object (expected a Chrome trace)");
    return j;
  } catch (const json::parse_error& e) {
    fail(ErrorKind::Data, "trace: ", path, " is not valid JSON (byte ", e.byte, "; expected a Chrome trace)");
  }
}

// otherData.KEY as a number; a missing or non-numeric field names the file.
double number_field(const json& od, const char* key, const std::string& path) {
  auto it = od.find(key);
  if (it == od.end() || !it->is_number())
    fail(ErrorKind::Data, "trace: ", path, ": otherData.", key, " is missing or not a number");
  return it->get<double>();
}

std::string string_field(const json& od, const char* key, const std::string& path) {
  auto it = od.find(key);
  if (it == od.end() || !it->is_string())
    fail(ErrorKind::Data, "trace: ", path, ": otherData.", key, " is missing or not a string");
  return it->get<std::string>();
}

// The document's otherData after checking its format and traceEvents.
const json& header(const json& doc, const std::string& path, const char* format) {
  auto od = doc.find("otherData");
  if (od == doc.end() || !od->is_object())
    fail(ErrorKind::Data, "trace: ", path, " has no otherData object (expected format \"", format, "\")");
  const std::string f = od->contains("format") && (*od)["format"].is_string() ? (*od)["format"].get<std::string>() : "";
  if (f != format) fail(ErrorKind::Data, "trace: ", path, ": format \"", f, "\", expected \"", format, "\"");
  auto ev = doc.find("traceEvents");
  if (ev == doc.end() || !ev->is_array()) fail(ErrorKind::Data, "trace: ", path, " has no traceEvents array");
  return *od;
}

// Every complete event has a name, a finite timestamp and a duration >= 0.
void check_events(const json& events, const std::string& path) {
  for (size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string())
      fail(ErrorKind::Data, "trace: ", path, ": traceEvents[", i, "] is not an event (no \"ph\")");
    if (e["ph"] != "X") continue;
    const bool ok = e.contains("name") && e["name"].is_string() && e.contains("ts") && e["ts"].is_number() &&
                    e.contains("dur") && e["dur"].is_number() && std::isfinite(e["ts"].get<double>()) &&
                    e["dur"].get<double>() >= 0;
    if (!ok)
      fail(ErrorKind::Data, "trace: ", path, ": traceEvents[", i,
           "] is a complete event without a name, a finite ts and a dur >= 0");
  }
}

// N of rank_N.json, or -1 when the name has no plain number.
int rank_in_name(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  const std::string digits = name.substr(5, name.size() - 10);
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(digits);
}

RankTrace read_rank_file(const std::string& path, Trace& shape) {
  json doc = parse_file(path);
  const json& od = header(doc, path, kRankFormat);
  RankTrace r;
  r.path = path;
  r.rank = int(number_field(od, "rank", path));
  r.dp = int(number_field(od, "dp", path));
  r.cp = od.contains("cp") ? int(number_field(od, "cp", path)) : 0;
  r.tp = int(number_field(od, "tp", path));
  r.pp = int(number_field(od, "pp", path));
  r.clock_sync_us = number_field(od, "clock_sync_us", path);
  shape.world_size = int(number_field(od, "world_size", path));
  shape.first_step = int(number_field(od, "first_step", path));
  shape.last_step = int(number_field(od, "last_step", path));
  shape.job = string_field(od, "job", path);
  if (const int named = rank_in_name(path); named >= 0 && named != r.rank)
    fail(ErrorKind::Data, "trace: ", path, " holds rank ", r.rank, " (expected ", named, " from its name)");
  check_events(doc["traceEvents"], path);
  r.events = std::move(doc["traceEvents"]);
  return r;
}

// Each file agrees with the first on the job, the world size and the steps.
void check_same_run(const Trace& first, const Trace& other, const std::string& first_path, const std::string& path) {
  auto differs = [&](const char* what, const std::string& a, const std::string& b) {
    fail(ErrorKind::Data, "trace: ", path, ": ", what, " ", b, " differs from ", first_path, "'s ", a,
         " (expected the rank files of one run)");
  };
  if (other.world_size != first.world_size)
    differs("world_size", std::to_string(first.world_size), std::to_string(other.world_size));
  if (other.job != first.job) differs("job", "\"" + first.job + "\"", "\"" + other.job + "\"");
  if (other.first_step != first.first_step || other.last_step != first.last_step)
    differs("steps", str_cat(first.first_step, "-", first.last_step), str_cat(other.first_step, "-", other.last_step));
}

std::vector<std::string> rank_files(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec))
    fail(ErrorKind::Data, "trace: '", dir, "' does not exist (expected a metrics.trace directory)");
  if (!fs::is_directory(dir, ec))
    fail(ErrorKind::Data, "trace: '", dir, "' is not a directory (expected metrics.trace's)");
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 10 && n.rfind("rank_", 0) == 0 && n.substr(n.size() - 5) == ".json")
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank_%05d.json", rank);
  return buf;
}

// Puts the ranks in order and checks that each of 0..world-1 is there once.
void order_ranks(Trace& t, const std::string& where) {
  std::map<int, const RankTrace*> seen;
  for (const RankTrace& r : t.ranks) {
    if (r.rank < 0 || r.rank >= t.world_size)
      fail(ErrorKind::Data, "trace: ", r.path, ": rank ", r.rank, " is outside 0..", t.world_size - 1, " (world_size ",
           t.world_size, ")");
    auto [it, fresh] = seen.emplace(r.rank, &r);
    if (!fresh) fail(ErrorKind::Data, "trace: ", r.path, " and ", it->second->path, " both hold rank ", r.rank);
  }
  for (int r = 0; r < t.world_size; ++r)
    if (!seen.count(r))
      fail(ErrorKind::Data, "trace: ", where, ": rank ", r, " of world_size ", t.world_size, " is missing (no ",
           rank_file_name(r), ")");
  std::sort(t.ranks.begin(), t.ranks.end(), [](const RankTrace& a, const RankTrace& b) { return a.rank < b.rank; });
}

std::string process_label(const RankTrace& r) {
  return str_cat("rank ", r.rank, " (dp ", r.dp, ", tp ", r.tp, ", pp ", r.pp, ")");
}

}  // namespace

Trace load_rank_traces(const std::string& dir) {
  const std::vector<std::string> files = rank_files(dir);
  if (files.empty())
    fail(ErrorKind::Data, "trace: '", dir, "' holds no rank_*.json files (expected metrics.trace's output)");
  Trace t;
  for (size_t i = 0; i < files.size(); ++i) {
    Trace shape;
    RankTrace r = read_rank_file(files[i], shape);
    if (i == 0)
      t = std::move(shape);
    else
      check_same_run(t, shape, files[0], files[i]);
    t.ranks.push_back(std::move(r));
  }
  t.source = dir;
  order_ranks(t, dir);
  return t;
}

Trace load_merged_trace(const std::string& path) {
  json doc = parse_file(path);
  const json& od = header(doc, path, kMergedFormat);
  Trace t;
  t.source = path;
  t.job = od.contains("job") && od["job"].is_string() ? od["job"].get<std::string>() : "";
  t.world_size = int(number_field(od, "world_size", path));
  t.first_step = int(number_field(od, "first_step", path));
  t.last_step = int(number_field(od, "last_step", path));
  if (!od.contains("ranks") || !od["ranks"].is_array() || int(od["ranks"].size()) != t.world_size)
    fail(ErrorKind::Data, "trace: ", path, ": otherData.ranks is not an array of world_size ", t.world_size,
         " entries");
  for (const json& r : od["ranks"]) {
    RankTrace rt;
    rt.path = path;
    rt.rank = int(number_field(r, "rank", path));
    rt.dp = int(number_field(r, "dp", path));
    rt.cp = r.contains("cp") ? int(number_field(r, "cp", path)) : 0;
    rt.tp = int(number_field(r, "tp", path));
    rt.pp = int(number_field(r, "pp", path));
    rt.events = json::array();
    t.ranks.push_back(std::move(rt));
  }
  order_ranks(t, path);
  check_events(doc["traceEvents"], path);
  for (json& e : doc["traceEvents"]) {
    const int pid = e.contains("pid") && e["pid"].is_number_integer() ? e["pid"].get<int>() : -1;
    if (pid >= 0 && pid < t.world_size) t.ranks[size_t(pid)].events.push_back(std::move(e));
  }
  return t;
}

Trace load_trace(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec) && rank_files(path).empty() && fs::exists(fs::path(path) / "trace.json", ec))
    return load_merged_trace((fs::path(path) / "trace.json").string());
  if (fs::is_regular_file(path, ec)) return load_merged_trace(path);
  return load_rank_traces(path);
}

double clock_offset_us(const Trace& t, int rank) {
  return t.ranks[size_t(rank)].clock_sync_us - t.ranks[0].clock_sync_us;
}

nlohmann::ordered_json merge_traces(const Trace& t) {
  using ojson = nlohmann::ordered_json;
  ojson events = ojson::array(), ranks = ojson::array();
  for (const RankTrace& r : t.ranks) {
    ranks.push_back({{"rank", r.rank},
                     {"dp", r.dp},
                     {"cp", r.cp},
                     {"tp", r.tp},
                     {"pp", r.pp},
                     {"clock_offset_us", std::round(clock_offset_us(t, r.rank) * 1e3) / 1e3}});
    events.push_back(
        {{"ph", "M"}, {"name", "process_name"}, {"pid", r.rank}, {"tid", 0}, {"args", {{"name", process_label(r)}}}});
    events.push_back(
        {{"ph", "M"}, {"name", "process_sort_index"}, {"pid", r.rank}, {"tid", 0}, {"args", {{"sort_index", r.rank}}}});
    for (const json& e : r.events) {
      const std::string ph = e["ph"];
      const std::string name = e.value("name", "");
      if (ph == "M" && (name == "process_name" || name == "process_sort_index")) continue;  // ours above
      ojson o = e;
      o["pid"] = r.rank;
      // Both are microseconds with a nanosecond fraction; the difference keeps it.
      if (e.contains("ts") && e["ts"].is_number())
        o["ts"] = std::round((e["ts"].get<double>() - r.clock_sync_us) * 1e3) / 1e3;
      events.push_back(std::move(o));
    }
  }
  return {{"displayTimeUnit", "ms"},
          {"otherData",
           {{"format", kMergedFormat},
            {"job", t.job},
            {"world_size", t.world_size},
            {"first_step", t.first_step},
            {"last_step", t.last_step},
            {"clock", "steady, minus each rank's clock_sync_us"},
            {"ranks", std::move(ranks)}}},
          {"traceEvents", std::move(events)}};
}

void write_json_atomic(const std::string& path, const nlohmann::ordered_json& j) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) fail(ErrorKind::Data, "trace: cannot write '", tmp, "': ", std::strerror(errno));
  const std::string text = j.dump() + "\n";
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) {
    std::remove(tmp.c_str());
    fail(ErrorKind::Data, "trace: writing '", tmp, "' failed (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail(ErrorKind::Data, "trace: cannot rename '", tmp, "' to '", path, "': ", ec.message());
}

}  // namespace xirang::analysis::report
