// Offline checkpoint conversion (runtime/checkpoint/checkpoint_convert.h): layouts,
// safe destinations, the writer of a whole layout's rank files, resharding,
// and the import and export entry points. The safetensors and llm.c file
// formats are in model_files.cc.
#include "runtime/checkpoint/checkpoint_convert.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "comm/communicator.h"
#include "comm/process_grid.h"
#include "runtime/checkpoint/model_files.h"
#include "runtime/config/model_layout.h"
#include "models/placement.h"

namespace xirang {

namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------------------
// Destinations

// Absolute, normalised, without a trailing separator ("ck/" and "ck" are one path).
fs::path clean(const std::string& p) {
  fs::path a = fs::absolute(p).lexically_normal();
  if (a.filename().empty()) a = a.parent_path();
  return a;
}

// Whether `inner` is `outer` or lies inside it (symbolic links resolved).
bool within(const fs::path& inner, const fs::path& outer) {
  const fs::path a = fs::weakly_canonical(inner), b = fs::weakly_canonical(outer);
  return std::mismatch(a.begin(), a.end(), b.begin(), b.end()).second == b.end();
}

// An empty directory, or one holding `latest` or step directories.
bool looks_like_checkpoint_root(const fs::path& dir) {
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n == "latest" || n.rfind("step_", 0) == 0) return true;
  }
  return fs::is_empty(dir);
}

// Refuses a destination that is the source, holds it or lies inside it
// (even with `overwrite`), and an existing one without `overwrite`. A
// checkpoint destination replaces only a directory that looks like a
// checkpoint root; a file destination only a file.
void check_destination(const std::string& src_arg, const std::string& dst_arg, bool overwrite, bool root) {
  const fs::path src = clean(src_arg), dst = clean(dst_arg);
  if (within(dst, src))
    fail(ErrorKind::Data, "destination '", dst_arg, "' is the source '", src_arg,
         "' or lies inside it; the source is never written");
  if (within(src, dst))
    fail(ErrorKind::Data, "destination '", dst_arg, "' holds the source '", src_arg,
         "'; replacing it would destroy the source");
  if (!fs::exists(fs::symlink_status(dst))) return;
  if (!overwrite)
    fail(ErrorKind::Data, "destination '", dst_arg, "' already exists; refusing to replace it (--force replaces it)");
  if (root && !(fs::is_directory(dst) && looks_like_checkpoint_root(dst)))
    fail(ErrorKind::Data, "destination '", dst_arg,
         "' exists and is not a checkpoint directory; refusing to replace it, even with --force");
  if (!root && fs::is_directory(dst))
    fail(ErrorKind::Data, "destination '", dst_arg, "' is a directory; expected a file name");
}

// A checkpoint root built beside its destination (DST.converting/) and
// renamed into place once complete, so DST never holds a partial
// conversion; removed when publish() is never reached.
class StagedRoot {
 public:
  explicit StagedRoot(fs::path dst) : dst_(std::move(dst)), stage_(dst_.string() + ".converting") {
    std::error_code ec;
    fs::remove_all(stage_, ec);  // what a crashed earlier conversion left
    fs::create_directories(stage_, ec);
    if (ec) fail(ErrorKind::Data, "cannot create '", stage_.string(), "': ", ec.message());
  }
  ~StagedRoot() {
    std::error_code ec;
    if (!published_) fs::remove_all(stage_, ec);
  }
  StagedRoot(const StagedRoot&) = delete;
  StagedRoot& operator=(const StagedRoot&) = delete;
  std::string path() const { return stage_.string(); }
  // Moves an existing destination aside, the staged root into its place, then removes the old one.
  void publish() {
    const fs::path old = dst_.string() + ".replaced";
    std::error_code ec;
    fs::remove_all(old, ec);
    if (fs::exists(fs::symlink_status(dst_))) fs::rename(dst_, old, ec);
    if (!ec) fs::rename(stage_, dst_, ec);
    if (ec) fail(ErrorKind::Data, "cannot move '", stage_.string(), "' to '", dst_.string(), "': ", ec.message());
    published_ = true;
    fs::remove_all(old, ec);
    sync_directory(dst_.parent_path().string());
  }

 private:
  fs::path dst_, stage_;
  bool published_ = false;
};

// ---------------------------------------------------------------------------
// Writing every rank file of a layout

// What a new checkpoint holds, wherever the values come from.
struct CheckpointContent {
  int64_t step = 0;
  std::string config_yaml;
  std::map<std::string, CheckpointScalar, std::less<>> scalars;  // written to every rank file
  // The stored dtype of a parameter, and its whole local shard in that dtype.
  std::function<DType(const Parameter&)> param_dtype;
  std::function<void(const Parameter&, Tensor)> read_param;
  // Optimizer-state groups ("adam_m", "adam_v", "master"), stored per
  // parameter; state_dtype is nullopt when the group has no such tensor.
  std::vector<std::string> state_groups;
  std::function<std::optional<DType>(const std::string& group, const Parameter&)> state_dtype;
  std::function<void(const std::string& group, const Parameter&, int64_t begin, int64_t end, Tensor)> read_state;
};

// Writes step c.step of `layout` under `root` and commits it; returns the
// number of entries written. Each rank file holds what that rank's trainer
// saves: dp rank 0 of each tp/pp position its parameters (not the last
// stage's copy of the tied table), the optimizer state whole on dp rank 0
// or, under ZeRO-1, split evenly over the dp ranks (any split loads: the
// pieces describe themselves), and the scalars on every rank.
int64_t write_checkpoint_root(const std::string& root, const ModelDims& dims, const CheckpointLayout& layout,
                              const CheckpointContent& c) {
  CheckpointDir dir(root);
  const std::string tmp = dir.prepare(c.step);
  std::vector<unsigned char> buf;
  auto buffer = [&buf](Shape s, DType t) {
    buf.resize(size_t(s.numel()) * dtype_size(t));
    return Tensor(buf.data(), s, t);
  };
  int64_t entries = 0;
  for (int rank = 0; rank < layout.world_size(); ++rank) {
    const GridCoords at = grid_coords(GridShape{layout.dp, layout.tp, layout.pp}, rank);
    const std::vector<Parameter> params = rank_parameters(dims, layout, rank);
    RankCheckpointWriter w(tmp, rank, c.step);
    for (const Parameter& p : params) {
      if (p.tied_copy || at.dp != 0) continue;
      const Tensor t = buffer(p.value.shape(), c.param_dtype(p));
      c.read_param(p, t);
      w.add("params", p.name, p.shard, t);
      ++entries;
    }
    for (const std::string& group : c.state_groups)
      for (const Parameter& p : params) {
        const std::optional<DType> dt = c.state_dtype(group, p);
        if (p.tied_copy || !dt) continue;
        const int64_t n = p.value.numel();
        const auto [b, e] = layout.zero == 1 ? split_range(n, layout.dp, at.dp)
                                             : std::pair<int64_t, int64_t>(0, at.dp == 0 ? n : 0);
        if (b == e) continue;
        const Tensor t = buffer({e - b}, *dt);
        c.read_state(group, p, b, e, t);
        w.add(group, p.name, p.shard, b, e, t, *dt);
        ++entries;
      }
    for (const auto& [key, s] : c.scalars) {
      if (s.is_int) w.set_int(key, s.i);
      else w.set_double(key, s.d);
    }
    w.close();
  }
  CheckpointMeta meta;
  meta.step = c.step;
  meta.layout = layout;
  meta.config_yaml = c.config_yaml;
  dir.commit(meta, /*keep=*/0);
  return entries;
}

// Refuses a checkpoint whose tensors are not those of its own config's model
// (a parameter missing or of another shape, an entry this converter would
// not know where to put), before anything is written.
void check_checkpoint_model(const CheckpointReader& r, const std::vector<Parameter>& model) {
  std::set<std::string> names;
  for (const Parameter& p : model) {
    names.insert(p.name);
    if (!r.has("params", p.name))
      fail(ErrorKind::Checkpoint, "checkpoint ", r.dir(), " has no parameter '", p.name,
           "', which the model of its own config has");
    const Shape g = r.global_shape("params", p.name);
    if (g != p.shard.global)
      fail(ErrorKind::Checkpoint, "checkpoint ", r.dir(), ": parameter '", p.name, "' has shape ", g.str(),
           ", the model of its config expects ", p.shard.global.str());
  }
  for (const CheckpointEntry& e : r.entries())
    if (!names.count(e.name))
      fail(ErrorKind::Checkpoint, "checkpoint ", r.dir(), " holds '", e.group, "/", e.name,
           "', which is no parameter of the model of its config; refusing to drop it");
}

// Reads a checkpoint's own configuration (meta.json) as a Config.
Config checkpoint_config(const CheckpointReader& r) {
  return parse_stored_config(r.meta().config_yaml, (fs::path(r.dir()) / "meta.json").string());
}

std::string layout_str(const CheckpointLayout& l) {
  return str_cat("dp=", l.dp, ",tp=", l.tp, ",pp=", l.pp, ",zero=", l.zero, ",virtual_stages=", l.virtual_stages,
                 l.chunk_order == ChunkOrder::V ? ",chunk_order=v" : "");
}

}  // namespace

// ---------------------------------------------------------------------------
// Layouts

void check_checkpoint_layout(const ModelDims& dims, const CheckpointLayout& l) {
  auto refuse = [&](const std::string& why) { fail(ErrorKind::Config, "layout ", layout_str(l), ": ", why); };
  if (l.zero != 0 && l.zero != 1) refuse("zero must be 0 or 1");
  const std::string problem = layout_problem(dims, ParallelLayout{l.dp, l.tp, l.pp, l.virtual_stages});
  if (!problem.empty()) refuse(problem);
  if (l.chunk_order == ChunkOrder::V && (l.virtual_stages != 2 || l.pp < 2))
    refuse("a V places 2 chunks on each of 2 or more pipeline ranks");
}

std::vector<Parameter> rank_parameters(const ModelDims& dims, const CheckpointLayout& layout, int rank) {
  check_checkpoint_layout(dims, layout);
  XR_CHECK(0 <= rank && rank < layout.world_size(), "rank ", rank, " of ", layout.world_size());
  const GridCoords at = grid_coords(GridShape{layout.dp, layout.tp, layout.pp}, rank);
  const ModelArch& arch = model_arch(dims.arch);
  const ChunkMap map{layout.pp, layout.virtual_stages, layout.chunk_order};
  std::vector<Parameter> out;
  for (int c = 0; c < layout.virtual_stages; ++c) {
    const ChunkPlacement place = map.placement(dims.n_layer, at.pp, c);
    for (Parameter& p : arch.parameters(dims, place, layout.tp, at.tp)) out.push_back(std::move(p));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Formats

const char* model_format_name(ModelFormat f) {
  switch (f) {
    case ModelFormat::Checkpoint: return "xirang checkpoint";
    case ModelFormat::Safetensors: return "safetensors file";
    case ModelFormat::LlmC: return "llm.c model file";
  }
  return "?";
}

ModelFormat detect_model_format(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) fail(ErrorKind::Data, "'", path, "' does not exist");
  if (fs::is_directory(st)) {
    if (fs::is_regular_file(fs::path(path) / "meta.json") || CheckpointDir(path).latest()) return ModelFormat::Checkpoint;
    fail(ErrorKind::Data, "'", path, "' is a directory but no xirang checkpoint (no meta.json, no complete step)");
  }
  const std::optional<ModelFormat> sniffed = sniff_model_file(path);
  if (sniffed) return *sniffed;
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".safetensors") return ModelFormat::Safetensors;
  if (ext == ".bin") return ModelFormat::LlmC;
  fail(ErrorKind::Data, "'", path, "' is in an unknown format: neither a xirang checkpoint directory, a safetensors ",
       "file (an 8-byte length, then a JSON header) nor an llm.c model file (magic ", kLlmcMagic, ")");
}

std::string checkpoint_step_dir(const std::string& path) {
  if (fs::is_regular_file(fs::path(path) / "meta.json")) return path;
  const std::optional<std::string> latest = CheckpointDir(path).latest();
  if (!latest) fail(ErrorKind::Checkpoint, "no complete checkpoint at '", path, "' (no meta.json, no complete step)");
  return *latest;
}

// ---------------------------------------------------------------------------
// Conversions

ConvertResult reshard_checkpoint(const std::string& src, const std::string& dst, const ConvertOptions& o) {
  const std::string step_dir = checkpoint_step_dir(src);
  const fs::path out = clean(dst);
  check_destination(src, dst, o.overwrite, /*root=*/true);
  const CheckpointReader r = CheckpointReader::open(step_dir);
  const ModelDims dims = checkpoint_config(r).model;
  check_checkpoint_model(r, rank_parameters(dims, CheckpointLayout{}, 0));
  const CheckpointLayout layout = o.layout.value_or(r.meta().layout);
  check_checkpoint_layout(dims, layout);

  // The dtype each (group, tensor) is stored in; groups other than params are optimizer state.
  std::map<std::pair<std::string, std::string>, DType> stored;
  for (const CheckpointEntry& e : r.entries()) stored.emplace(std::make_pair(e.group, e.name), e.dtype);
  CheckpointContent c;
  c.step = r.step();
  c.config_yaml = r.meta().config_yaml;
  // Scalars are per rank today only by convention (every rank saves the same step):
  // rank 0's go to every new rank.
  if (!r.meta().rank_files.empty()) c.scalars = r.scalars(0);
  c.param_dtype = [&](const Parameter& p) { return o.dtype.value_or(stored.at({"params", p.name})); };
  c.read_param = [&](const Parameter& p, Tensor t) { r.read("params", p.name, p.shard, t); };
  if (!o.params_only)
    for (const auto& [key, dt] : stored)
      if (key.first != "params" && (c.state_groups.empty() || c.state_groups.back() != key.first))
        c.state_groups.push_back(key.first);
  c.state_dtype = [&](const std::string& group, const Parameter& p) -> std::optional<DType> {
    const auto it = stored.find({group, p.name});
    return it == stored.end() ? std::nullopt : std::optional<DType>(it->second);
  };
  c.read_state = [&](const std::string& group, const Parameter& p, int64_t b, int64_t e, Tensor t) {
    r.read(group, p.name, p.shard, b, e, t);
  };
  fs::create_directories(out.parent_path());
  StagedRoot stage(out);
  ConvertResult res;
  res.tensors = write_checkpoint_root(stage.path(), dims, layout, c);
  stage.publish();
  res.path = CheckpointDir(out.string()).step_dir(c.step);
  res.step = c.step;
  res.layout = layout;
  res.optimizer_state = !c.state_groups.empty();
  return res;
}

ConvertResult export_hf_safetensors(const std::string& src, const std::string& dst, const ConvertOptions& o) {
  if (o.layout || o.params_only)
    fail(ErrorKind::Usage,
         "a safetensors export holds the whole model's parameters: a layout and params-only do not apply");
  const DType dtype = o.dtype.value_or(DType::F32);
  const std::string step_dir = checkpoint_step_dir(src);
  const fs::path out = clean(dst), config_json = out.parent_path() / "config.json";
  if (out == config_json)
    fail(ErrorKind::Usage, "'", dst, "': the model file cannot be named config.json (written next to it)");
  check_destination(src, dst, o.overwrite, /*root=*/false);
  check_destination(src, config_json.string(), o.overwrite, /*root=*/false);
  const CheckpointReader r = CheckpointReader::open(step_dir);
  const ModelDims dims = checkpoint_config(r).model;
  const ModelFileAdapter& files = file_adapter(model_arch(dims.arch));
  const std::vector<Parameter> params = rank_parameters(dims, CheckpointLayout{}, 0);
  check_checkpoint_model(r, params);
  fs::create_directories(out.parent_path());
  ConvertResult res;
  res.tensors = write_hf_safetensors(out.string(), config_json.string(), dims, files, params, dtype, r.step(),
                                     [&](const Parameter& p, std::vector<float>& values) {
                                       // A 16-bit run's fp32 master weights are the exact values.
                                       const char* group = r.has("master", p.name) ? "master" : "params";
                                       values.resize(size_t(p.shard.global.numel()));
                                       r.read(group, p.name, ShardSpec::whole(p.shard.global),
                                              Tensor(values.data(), {p.shard.global.numel()}, DType::F32));
                                     });
  res.path = out.string();
  res.step = r.step();
  return res;
}

ConvertResult import_model_file(const std::string& src, const Config& config, const std::string& dst,
                                const ConvertOptions& o) {
  const ModelFormat format = detect_model_format(src);
  if (format == ModelFormat::Checkpoint)
    fail(ErrorKind::Usage, "'", src, "' is a xirang checkpoint, not a model file to import (reshard it instead)");
  const ModelDims& dims = config.model;
  const ModelFileAdapter& files = file_adapter(model_arch(dims.arch));
  const CheckpointLayout layout = o.layout.value_or(CheckpointLayout{});
  check_checkpoint_layout(dims, layout);
  const DType dtype = o.dtype.value_or(DType::F32);
  const fs::path out = clean(dst);
  check_destination(src, dst, o.overwrite, /*root=*/true);

  // The whole model in host memory, in our layout, as f32 (exact for f32, bf16 and f16 files).
  HostModel m{rank_parameters(dims, CheckpointLayout{}, 0), {}};
  if (format == ModelFormat::Safetensors) read_hf_safetensors(src, config.model, files, m);
  else read_llmc_model(src, config.model, files, m);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < m.params.size(); ++i) index[m.params[i].name] = i;

  CheckpointContent c;
  c.step = 0;
  c.config_yaml = config.yaml;
  c.scalars["train.step"] = CheckpointScalar{true, 0, 0.0};
  c.param_dtype = [&](const Parameter&) { return dtype; };
  c.read_param = [&](const Parameter& p, Tensor t) {
    // The local shard, run by run (a run is consecutive in the global tensor too).
    const std::vector<float>& g = m.values[index.at(p.name)];
    const ShardMap map(p.shard);
    auto* dst_bytes = static_cast<unsigned char*>(t.raw());
    for (int64_t i = 0; i < map.numel();) {
      const int64_t n = map.run_left(i);
      convert_elements(g.data() + map.to_global(i), DType::F32, dst_bytes + size_t(i) * dtype_size(t.dtype()),
                       t.dtype(), n);
      i += n;
    }
  };
  c.state_dtype = [](const std::string&, const Parameter&) { return std::optional<DType>(); };
  fs::create_directories(out.parent_path());
  StagedRoot stage(out);
  ConvertResult res;
  res.tensors = write_checkpoint_root(stage.path(), dims, layout, c);
  stage.publish();
  res.path = CheckpointDir(out.string()).step_dir(0);
  res.layout = layout;
  return res;
}

}  // namespace xirang
