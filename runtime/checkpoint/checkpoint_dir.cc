// The step directory protocol of checkpoints (docs/checkpoint_format.md):
// prepare, commit, latest, pruning and meta.json. A step becomes visible
// only by renames of complete, synced files and directories, so a crash at
// any point leaves the previous checkpoint and `latest` intact.
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/checkpoint/hdf5_check.h"

namespace xirang {

namespace fs = std::filesystem;

namespace {

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

// "step_00000120" -> (120, complete dir); "step_00000120.tmp" or
// "step_00000120.old.tmp" -> (120, tmp); anything else -> nullopt.
struct StepName {
  int64_t step;
  bool tmp;
};
std::optional<StepName> parse_step_name(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return std::nullopt;
  size_t i = 5;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  if (i == 5 || i - 5 > 18) return std::nullopt;
  const int64_t step = std::stoll(name.substr(5, i - 5));
  const std::string rest = name.substr(i);
  if (rest.empty()) return StepName{step, false};
  if (rest.size() >= 4 && rest.compare(rest.size() - 4, 4, ".tmp") == 0) return StepName{step, true};
  return std::nullopt;
}

// Writes `content` to path via path.tmp, fsync and rename: readers see the old or the new file, never a mix.
void write_file_atomic(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << content;
    f.close();
    if (!f) fail(ErrorKind::Checkpoint, "cannot write ", tmp);
  }
  sync_path(tmp, false);
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    fail(ErrorKind::Checkpoint, "cannot rename ", tmp, " to ", path, ": ", std::strerror(errno));
  sync_path(fs::path(path).parent_path().string(), true);
}

bool is_complete(const fs::path& dir) { return fs::is_regular_file(dir / "meta.json"); }

// Opens a rank file and checks it is ours, for this rank and step: a missing,
// truncated or stale file fails here, before anything becomes visible.
void check_rank_file(const std::string& path, int rank, int64_t step) {
  try {
    H5Id f(XR_HDF5_ID(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)), H5Fclose);
    if (read_attr_str(f, "format") != "xirang-checkpoint") fail(ErrorKind::Checkpoint, "not a Xirang rank file");
    const int64_t r = read_attr_i64(f, "rank"), s = read_attr_i64(f, "step");
    if (r != rank || s != step)
      fail(ErrorKind::Checkpoint, "holds rank ", r, " step ", s, ", expected rank ", rank, " step ", step);
  } catch (...) {
    rethrow_as_checkpoint(str_cat("checkpoint step ", step, " cannot be committed: rank file ", path));
  }
}

// Every rank file of a world of `world` ranks is present in tmp and is what
// it claims to be; returns their names, in rank order.
std::vector<std::string> check_rank_files(const fs::path& tmp, int64_t step, int world) {
  std::vector<std::string> names;
  for (int r = 0; r < world; ++r) {
    const std::string name = rank_file_name(r);
    const fs::path p = tmp / name;
    if (!fs::is_regular_file(p))
      fail(ErrorKind::Checkpoint, "checkpoint step ", step, " cannot be committed: rank file ", name,
           " is missing from ", tmp.string(), " (did rank ", r, " finish writing?)");
    check_rank_file(p.string(), r, step);
    names.push_back(name);
  }
  return names;
}

// Strays: a crashed earlier attempt's partial files, or rank files of a larger world.
void remove_strays(const fs::path& tmp, const std::vector<std::string>& rank_files) {
  std::set<std::string> expected(rank_files.begin(), rank_files.end());
  expected.insert("meta.json");
  for (const auto& e : fs::directory_iterator(tmp))
    if (!expected.count(e.path().filename().string())) fs::remove_all(e.path());
}

// The text of meta.json (read back by read_checkpoint_meta).
std::string meta_json_text(const CheckpointMeta& meta) {
  nlohmann::json j;
  j["format"] = "xirang-checkpoint";
  j["format_version"] = kCheckpointFormatVersion;
  j["step"] = meta.step;
  j["layout"] = {{"dp", meta.layout.dp},
                 {"tp", meta.layout.tp},
                 {"pp", meta.layout.pp},
                 {"zero", meta.layout.zero},
                 {"virtual_stages", meta.layout.virtual_stages},
                 {"sequence_parallel", meta.layout.sequence_parallel},
                 {"chunk_order", meta.layout.chunk_order == ChunkOrder::V ? "v" : "round_robin"}};
  j["world_size"] = meta.layout.world_size();
  j["rank_files"] = meta.rank_files;
  j["config"] = meta.config_yaml;
  return j.dump(2) + "\n";
}

// Renames the complete tmp directory to final_dir. Re-saving a step swaps the
// directories atomically (RENAME_EXCHANGE), so `latest` never names a missing
// directory; where the file system cannot swap, the old one is moved aside first.
void move_into_place(const fs::path& tmp, const fs::path& final_dir) {
  if (!fs::exists(final_dir)) {
    fs::rename(tmp, final_dir);
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp);  // now holds the old save
    return;
  }
  const fs::path aside = final_dir.string() + ".old.tmp";
  fs::remove_all(aside);
  fs::rename(final_dir, aside);
  fs::rename(tmp, final_dir);
  fs::remove_all(aside);
}

// After committing `step`: removes the *.tmp directories of steps up to it
// and keeps, besides it, the newest keep - 1 complete steps (keep <= 0: all).
void prune_steps(const CheckpointDir& dir, int64_t step, int keep) {
  std::vector<int64_t> others;
  for (const auto& e : fs::directory_iterator(dir.root())) {
    const auto sn = parse_step_name(e.path().filename().string());
    if (!sn || !e.is_directory()) continue;
    if (sn->tmp) {
      if (sn->step <= step) fs::remove_all(e.path());  // a crashed save; later ones may be in flight
    } else if (sn->step != step && is_complete(e.path())) {
      others.push_back(sn->step);
    }
  }
  if (keep > 0) {
    std::sort(others.rbegin(), others.rend());
    for (size_t i = size_t(keep - 1); i < others.size(); ++i) fs::remove_all(dir.step_dir(others[i]));
  }
}

}  // namespace

// fsync makes a write or a rename durable; the rename of a file is only
// durable once its directory is synced too.
void sync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | (directory ? O_DIRECTORY : 0));
  if (fd < 0) fail(ErrorKind::Checkpoint, "cannot open ", path, " to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail(ErrorKind::Checkpoint, "fsync of ", path, " failed: ", std::strerror(err));
}

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank_%05d.h5", rank);
  return buf;
}

namespace {

// An integer field of meta.json within [lo, hi]; a float, a string or a value
// out of range is refused with the field's name (a conversion of an
// out-of-range number would be undefined).
int64_t meta_integer(const nlohmann::json& j, const char* key, int64_t lo, int64_t hi) {
  const nlohmann::json& v = j.at(key);
  bool ok = v.is_number_integer();
  int64_t x = 0;
  if (ok && v.is_number_unsigned()) {
    ok = v.get<uint64_t>() <= uint64_t(hi);
    if (ok) x = int64_t(v.get<uint64_t>());
  } else if (ok) {
    x = v.get<int64_t>();
  }
  if (!ok || x < lo || x > hi) {
    std::string shown = v.dump();
    if (shown.size() > 40) shown = shown.substr(0, 40) + "...";
    fail(ErrorKind::Checkpoint, "'", key, "' is ", shown, " (expected an integer in ", lo, "..", hi, ")");
  }
  return x;
}

}  // namespace

CheckpointMeta read_checkpoint_meta(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / "meta.json").string();
  std::ifstream f(path);
  if (!f) fail(ErrorKind::Checkpoint, step_dir, " is not a complete checkpoint: ", path, " is missing");
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    if (j.at("format").get<std::string>() != "xirang-checkpoint")
      fail(ErrorKind::Checkpoint, "format is not xirang-checkpoint");
    CheckpointMeta m;
    const nlohmann::json& version = j.at("format_version");
    if (version.is_number_integer() && version.get<int64_t>() > kCheckpointFormatVersion)
      fail(ErrorKind::Checkpoint, "format_version ", version.get<int64_t>(), " is not supported (this build reads 1..",
           kCheckpointFormatVersion, ")");
    m.format_version = int(meta_integer(j, "format_version", 1, kCheckpointFormatVersion));
    m.step = meta_integer(j, "step", 0, std::numeric_limits<int64_t>::max());
    const auto& l = j.at("layout");
    constexpr int64_t kMaxRanks = int64_t(1) << 24;
    m.layout.dp = int(meta_integer(l, "dp", 1, kMaxRanks));
    m.layout.tp = int(meta_integer(l, "tp", 1, kMaxRanks));
    m.layout.pp = int(meta_integer(l, "pp", 1, kMaxRanks));
    if (int64_t(m.layout.dp) * m.layout.tp * m.layout.pp > kMaxRanks)
      fail(ErrorKind::Checkpoint, "layout dp ", m.layout.dp, " x tp ", m.layout.tp, " x pp ", m.layout.pp,
           " is more than ", kMaxRanks, " ranks");
    m.layout.zero = int(meta_integer(l, "zero", 0, 1));
    m.layout.virtual_stages = int(meta_integer(l, "virtual_stages", 1, kMaxRanks));
    m.layout.sequence_parallel = l.at("sequence_parallel").get<bool>();
    // Absent before zb_v ran in the executor: round-robin.
    if (l.contains("chunk_order")) {
      const std::string order = l.at("chunk_order").get<std::string>();
      if (order != "v" && order != "round_robin")
        fail(ErrorKind::Checkpoint, "layout chunk_order '", order, "' is not one of round_robin, v");
      m.layout.chunk_order = order == "v" ? ChunkOrder::V : ChunkOrder::RoundRobin;
    }
    m.config_yaml = j.at("config").get<std::string>();
    m.rank_files = j.at("rank_files").get<std::vector<std::string>>();
    if (int64_t(m.rank_files.size()) != m.layout.world_size())
      fail(ErrorKind::Checkpoint, m.rank_files.size(), " rank files for a world of ", m.layout.world_size());
    return m;
  } catch (...) {
    rethrow_as_checkpoint(str_cat("checkpoint metadata ", path));
  }
}

std::string CheckpointDir::step_dir(int64_t step) const { return (fs::path(root_) / step_name(step)).string(); }
std::string CheckpointDir::tmp_dir(int64_t step) const { return step_dir(step) + ".tmp"; }

std::string CheckpointDir::prepare(int64_t step) const {
  const std::string tmp = tmp_dir(step);
  try {
    fs::create_directories(root_);
    fs::remove_all(tmp);
    fs::create_directory(tmp);
  } catch (...) {
    rethrow_as_checkpoint(str_cat("cannot prepare checkpoint directory ", tmp));
  }
  return tmp;
}

void CheckpointDir::commit(const CheckpointMeta& meta_in, int keep) const {
  Hdf5Scope scope;
  CheckpointMeta meta = meta_in;
  if (meta.layout.dp < 1 || meta.layout.tp < 1 || meta.layout.pp < 1)
    fail(ErrorKind::Checkpoint, "checkpoint step ", meta.step, ": layout dp ", meta.layout.dp, " tp ", meta.layout.tp,
         " pp ", meta.layout.pp, " must all be >= 1");
  const fs::path tmp = tmp_dir(meta.step), final_dir = step_dir(meta.step);
  if (!fs::is_directory(tmp))
    fail(ErrorKind::Checkpoint, "checkpoint step ", meta.step, " cannot be committed: ", tmp.string(), " does not exist");

  meta.rank_files = check_rank_files(tmp, meta.step, meta.layout.world_size());
  try {
    remove_strays(tmp, meta.rank_files);
    // meta.json last inside the directory: its presence marks the directory complete.
    write_file_atomic((tmp / "meta.json").string(), meta_json_text(meta));
    move_into_place(tmp, final_dir);
    sync_path(root_, true);
    write_file_atomic((fs::path(root_) / "latest").string(), step_name(meta.step) + "\n");
    prune_steps(*this, meta.step, keep);
  } catch (...) {
    rethrow_as_checkpoint(str_cat("committing checkpoint step ", meta.step, " in ", root_));
  }
}

std::optional<std::string> CheckpointDir::latest() const {
  std::ifstream f(fs::path(root_) / "latest");
  std::string name;
  if (f >> name) {
    const auto sn = parse_step_name(name);
    const fs::path dir = fs::path(root_) / name;
    if (sn && !sn->tmp && is_complete(dir)) return dir.string();
  }
  const auto steps = complete_steps();
  if (steps.empty()) return std::nullopt;
  return step_dir(steps.back());
}

std::vector<int64_t> CheckpointDir::complete_steps() const {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const auto sn = parse_step_name(e.path().filename().string());
    if (sn && !sn->tmp && e.is_directory() && is_complete(e.path())) steps.push_back(sn->step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace xirang
