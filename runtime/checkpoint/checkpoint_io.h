// runtime/checkpoint/checkpoint_io.h: the checkpoint storage layer: any layout saves,
// any layout loads.
//
// Owns the on-disk format (docs/checkpoint_format.md). A checkpoint root
// holds step directories (step_00000120/), each with one HDF5 file per rank
// (rank_00003.h5) and a meta.json written last, plus `latest`, a text file
// naming the newest complete step directory. Every tensor entry in a rank
// file describes itself: its global shape, the shard it belongs to (a
// ShardSpec), the flat element range of that shard it holds (ZeRO pieces),
// the stored dtype and a CRC-32C per chunk of stored bytes. A reader in any
// other layout therefore fills its own shard from whichever entries hold
// its elements, reading only the entries that overlap it.
//
// Writes are atomic: a rank file is written as *.h5.tmp and renamed after it
// is closed and synced; a step directory is written as step_N.tmp/ and
// renamed by commit() once every rank file and meta.json are complete; then
// `latest` is replaced by rename. A crash at any point leaves the previous
// checkpoint and `latest` intact. This layer never communicates: the caller
// puts the barriers between prepare, the writes and commit.
//
//   CheckpointDir dir("runs/ckpt");
//   std::string tmp = dir.prepare(step);                 // one rank; then a barrier
//   RankCheckpointWriter w(tmp, rank, step);             // every rank
//   for (const Parameter& p : model.parameters()) w.add("params", p.name, p.shard, p.value);
//   w.add("adam_m", p.name, p.shard, begin, end, m, DType::F32);  // a ZeRO piece of the shard
//   w.set_int("data.position", position);
//   w.close();                                           // then a barrier
//   dir.commit(meta, /*keep=*/3);                        // one rank
//
//   CheckpointReader r = CheckpointReader::open_latest("runs/ckpt");
//   r.read("params", p.name, p.shard, p.value);          // this rank's shard, any layout
//   r.read("adam_m", p.name, p.shard, begin, end, m);    // a piece of it
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "models/parameter.h"  // ShardSpec
#include "models/placement.h"  // ChunkOrder

namespace xirang {

inline constexpr int kCheckpointFormatVersion = 1;

// ---------------------------------------------------------------------------
// Shard geometry

// Empty when `s` describes a valid shard, else what is wrong with it.
std::string shard_spec_problem(const ShardSpec& s);
// The shape of the local tensor a shard holds: ShardSpec::local_shape().

// ShardSpec::global_index generalised to any rank, with its inverse. Local
// elements come in runs of consecutive elements that are also consecutive in
// the global tensor (one block of the split dimension, times the trailing
// dimensions), which lets the reader copy whole runs instead of elements.
class ShardMap {
 public:
  explicit ShardMap(const ShardSpec& s);  // s must be valid (shard_spec_problem)
  const Shape& local() const { return local_; }
  int64_t numel() const { return numel_; }
  int64_t global_numel() const { return global_numel_; }
  int64_t to_global(int64_t i) const;  // local flat -> global flat
  int64_t to_local(int64_t g) const;   // global flat -> local flat, or -1 when not in this shard
  // Elements from local i to the end of its run (all of them map to consecutive global indices).
  int64_t run_left(int64_t i) const;

 private:
  Shape local_;
  int64_t numel_ = 0, global_numel_ = 0;
  bool whole_ = true;
  int64_t inner_ = 1;  // product of the dimensions after the split one
  int64_t G_ = 1, L_ = 1;  // split dimension: global and local extent
  int64_t lb_ = 1, gb_ = 1;  // per block: local and global extent (equal blocks)
  // Blocks of unequal extents (ShardSpec::block_sizes), along the split dimension.
  struct Block {
    int64_t local_begin, local_extent, global_begin;
  };
  std::vector<Block> blocks_;
  bool equal_ = true;
  const Block& local_block(int64_t x) const;
  int64_t index_ = 0, parts_ = 1;
  int64_t run_ = 1;
};

// CRC-32C (Castagnoli; hardware instruction where available), continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

// Element conversion between the float dtypes (f32, f64, bf16, f16);
// narrowing rounds to nearest even.
void convert_elements(const void* src, DType from, void* dst, DType to, int64_t n);

// ---------------------------------------------------------------------------
// Step directories, meta.json, commit

// The layout the checkpoint was saved in (informational: entries describe
// themselves, so loading never needs it).
struct CheckpointLayout {
  int dp = 1, tp = 1, pp = 1;
  int zero = 0;            // ZeRO stage of the optimizer state
  int virtual_stages = 1;  // model chunks per pipeline rank
  bool sequence_parallel = false;
  ChunkOrder chunk_order = ChunkOrder::RoundRobin;  // V under zb_v: which rank file holds which layers
  int world_size() const { return dp * tp * pp; }
};

struct CheckpointMeta {
  int format_version = kCheckpointFormatVersion;
  int64_t step = 0;
  CheckpointLayout layout;
  std::string config_yaml;              // the run's configuration, as text
  std::vector<std::string> rank_files;  // "rank_00000.h5", ...; commit() fills it
};

// "rank_00003.h5"
std::string rank_file_name(int rank);
// Reads and checks step_dir/meta.json (a Checkpoint error when missing or malformed).
CheckpointMeta read_checkpoint_meta(const std::string& step_dir);

class CheckpointDir {
 public:
  explicit CheckpointDir(std::string root) : root_(std::move(root)) {}
  const std::string& root() const { return root_; }
  std::string step_dir(int64_t step) const;  // root/step_00000120
  std::string tmp_dir(int64_t step) const;   // root/step_00000120.tmp
  // Creates an empty tmp_dir(step), removing what a crashed earlier attempt
  // left there; returns its path. One rank calls it before the others write.
  std::string prepare(int64_t step) const;
  // Completes step meta.step: checks that every rank file of
  // meta.layout.world_size() ranks is present and readable, removes strays
  // (unexpected rank files, *.tmp files), writes meta.json, renames the
  // directory into place (atomically replacing an earlier save of the same
  // step), points `latest` at it, then removes the complete steps beyond the
  // newest `keep` (keep <= 0: keep all) and the *.tmp directories of steps
  // up to this one. Throws a Checkpoint error, changing nothing visible, when
  // a rank file is missing or damaged.
  void commit(const CheckpointMeta& meta, int keep) const;
  // The newest complete step directory: the one `latest` names, or, when
  // `latest` is missing or names no complete directory, the highest
  // complete step found by listing. nullopt when there is none.
  std::optional<std::string> latest() const;
  // Steps with a complete directory (meta.json present), ascending.
  std::vector<int64_t> complete_steps() const;

 private:
  std::string root_;
};

// ---------------------------------------------------------------------------
// Writing one rank's file

struct CheckpointWriterOptions {
  int64_t checksum_chunk = int64_t(1) << 18;  // elements per CRC (partial reads verify whole chunks)
};

class RankCheckpointWriter {
 public:
  // Creates step_dir if needed and step_dir/rank_XXXXX.h5.tmp.
  RankCheckpointWriter(const std::string& step_dir, int rank, int64_t step, CheckpointWriterOptions options = {});
  // Without close(): removes the partial file (an aborted save leaves nothing that looks complete).
  ~RankCheckpointWriter();
  RankCheckpointWriter(const RankCheckpointWriter&) = delete;
  RankCheckpointWriter& operator=(const RankCheckpointWriter&) = delete;

  // The whole local shard `shard` (global shape inside), stored in data's dtype.
  void add(std::string_view group, std::string_view name, const ShardSpec& shard, const Tensor& data);
  // Elements [flat_begin, flat_end) of the local shard's flat view (data holds
  // exactly those, host memory), stored as `store_as` (f32, f64, bf16, f16).
  void add(std::string_view group, std::string_view name, const ShardSpec& shard, int64_t flat_begin,
           int64_t flat_end, const Tensor& data, DType store_as);
  // Named per-rank values: schedule position, loss scale, data position, RNG offsets.
  void set_int(std::string_view key, int64_t value);
  void set_double(std::string_view key, double value);
  // Closes, syncs, and renames the file to rank_XXXXX.h5.
  void close();
  const std::string& path() const { return path_; }  // the final name

 private:
  void abandon() noexcept;
  std::string dir_, path_, tmp_path_;
  int rank_;
  int64_t step_;
  CheckpointWriterOptions opt_;
  int64_t file_ = -1;     // hid_t (kept out of this header)
  int64_t scalars_ = -1;  // hid_t of the /scalars group
};

// ---------------------------------------------------------------------------
// Reading any layout

// One stored tensor entry (one dataset of one rank file).
struct CheckpointEntry {
  std::string group, name;  // "params", "h.0.attn.c_attn.weight"
  std::string file;         // path of the rank file
  int rank = 0;
  std::string dataset;      // HDF5 path: "/params/h.0.attn.c_attn.weight"
  ShardSpec shard;          // global shape and the shard whose elements this entry holds
  Shape local;              // that shard's shape
  int64_t flat_begin = 0, flat_end = 0;  // the stored range of the shard's flat view
  DType dtype = DType::F32;              // stored dtype
  int64_t checksum_chunk = 0;            // elements per CRC
  std::vector<uint32_t> checksums;       // CRC-32C of each chunk of stored bytes
  int64_t numel() const { return flat_end - flat_begin; }
};

// A per-rank named value.
struct CheckpointScalar {
  bool is_int = true;
  int64_t i = 0;
  double d = 0;
};

class CheckpointReader {
 public:
  // Reads step_dir/meta.json and indexes every entry of every rank file
  // (attributes only; no tensor data).
  static CheckpointReader open(const std::string& step_dir);
  // The newest complete checkpoint under root (CheckpointDir::latest).
  static CheckpointReader open_latest(const std::string& root);

  const std::string& dir() const { return dir_; }
  const CheckpointMeta& meta() const { return meta_; }
  int64_t step() const { return meta_.step; }
  // Every entry, sorted by group, name, rank, flat_begin.
  const std::vector<CheckpointEntry>& entries() const { return entries_; }
  bool has(std::string_view group, std::string_view name) const;
  Shape global_shape(std::string_view group, std::string_view name) const;

  // Fills `out` (host, a float dtype, flat_end - flat_begin elements) with
  // elements [flat_begin, flat_end) of the local shard `want` (any layout),
  // gathered from whichever stored entries hold them, converted to out's
  // dtype. Only overlapping entries are read, and only the checksum chunks
  // that cover the overlap; each chunk read is verified.
  void read(std::string_view group, std::string_view name, const ShardSpec& want, int64_t flat_begin,
            int64_t flat_end, Tensor out) const;
  // The whole local shard.
  void read(std::string_view group, std::string_view name, const ShardSpec& want, Tensor out) const;

  bool has_scalar(int rank, std::string_view key) const;
  int64_t get_int(int rank, std::string_view key) const;
  double get_double(int rank, std::string_view key) const;
  const std::map<std::string, CheckpointScalar, std::less<>>& scalars(int rank) const;

  // Reads every entry in full and checks its checksums; one line per damaged
  // entry (naming the tensor and the file), empty when all are intact.
  std::vector<std::string> verify_all() const;

 private:
  CheckpointReader() = default;
  const std::vector<size_t>& entries_of(std::string_view group, std::string_view name) const;
  std::string dir_;
  CheckpointMeta meta_;
  std::vector<CheckpointEntry> entries_;
  std::map<std::pair<std::string, std::string>, std::vector<size_t>> index_;  // (group, name) -> entries_
  std::vector<std::map<std::string, CheckpointScalar, std::less<>>> scalars_;  // per rank
};

}  // namespace xirang
