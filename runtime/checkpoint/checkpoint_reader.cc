// CheckpointReader: indexes every entry of every rank file of a step, then
// fills any layout's shard from the entries that hold its elements.
#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <tuple>

#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/checkpoint/hdf5_check.h"

namespace xirang {

namespace fs = std::filesystem;

namespace {

Shape shape_from(const std::vector<int64_t>& dims, const char* what) {
  if (dims.size() > size_t(Shape::kMaxRank)) fail(ErrorKind::Checkpoint, what, " has rank ", dims.size());
  Shape s;
  for (int64_t d : dims) s.push_back(d);
  return s;
}

// An attribute that the reader keeps in an int: refused outside [lo, INT_MAX]
// rather than narrowed into another, plausible value.
int read_attr_int(hid_t dset, const char* name, int64_t lo) {
  const int64_t v = read_attr_i64(dset, name);
  if (v < lo || v > INT_MAX)
    fail(ErrorKind::Checkpoint, "attribute '", name, "' is ", v, " (expected ", lo, "..", INT_MAX, ")");
  return int(v);
}

// Chunks of `chunk` elements covering n elements (chunk > 0, n >= 0), without overflow.
int64_t chunks_of(int64_t n, int64_t chunk) { return n == 0 ? 0 : (n - 1) / chunk + 1; }

DType stored_dtype(const std::string& s) {
  if (s == "f32") return DType::F32;
  if (s == "f64") return DType::F64;
  if (s == "bf16") return DType::BF16;
  if (s == "f16") return DType::F16;
  fail(ErrorKind::Checkpoint, "unknown stored dtype '", s, "'");
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIx32, v);
  return buf;
}

// "(48, 0)": the coordinates of global flat index g.
std::string coords(const Shape& s, int64_t g) {
  std::vector<int64_t> c(size_t(s.rank()));
  for (int i = s.rank() - 1; i >= 0; --i) {
    c[size_t(i)] = s[i] ? g % s[i] : 0;
    g = s[i] ? g / s[i] : 0;
  }
  std::string out = "(";
  for (size_t i = 0; i < c.size(); ++i) out += (i ? ", " : "") + std::to_string(c[i]);
  return out + ")";
}

std::vector<std::string> link_names(hid_t loc) {
  H5G_info_t info;
  XR_HDF5_CHECK(H5Gget_info(loc, &info));
  std::vector<std::string> names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    ssize_t len = H5Lget_name_by_idx(loc, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    XR_HDF5_CHECK(len);
    std::string name(size_t(len) + 1, '\0');
    XR_HDF5_CHECK(H5Lget_name_by_idx(loc, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(), H5P_DEFAULT));
    name.resize(size_t(len));
    names.push_back(name);
  }
  return names;
}

// An entry's description from its dataset's attributes, checked for
// consistency so that a damaged header fails here rather than as a wrong read.
CheckpointEntry describe(hid_t dset, const std::string& group, const std::string& ds_name) {
  CheckpointEntry e;
  e.group = group;
  e.dataset = "/" + group + "/" + ds_name;
  e.name = read_attr_str(dset, "name");
  e.shard.global = shape_from(read_attr_i64s(dset, "global_shape"), "global_shape");
  e.shard.dim = read_attr_int(dset, "split_dim", -1);
  e.shard.parts = read_attr_int(dset, "parts", 1);
  e.shard.index = read_attr_int(dset, "index", 0);
  e.shard.blocks = read_attr_int(dset, "blocks", 1);
  // Unequal blocks (grouped-query q, k, v) also list their extents.
  if (has_attr(dset, "block_sizes")) e.shard.block_sizes = read_attr_i64s(dset, "block_sizes");
  const std::string problem = shard_spec_problem(e.shard);
  if (!problem.empty()) fail(ErrorKind::Checkpoint, "shard: ", problem);
  e.local = e.shard.local_shape();
  if (shape_from(read_attr_i64s(dset, "local_shape"), "local_shape") != e.local)
    fail(ErrorKind::Checkpoint, "local_shape disagrees with the shard");
  e.flat_begin = read_attr_i64(dset, "flat_begin");
  e.flat_end = read_attr_i64(dset, "flat_end");
  if (!(0 <= e.flat_begin && e.flat_begin <= e.flat_end && e.flat_end <= e.local.numel()))
    fail(ErrorKind::Checkpoint, "flat range [", e.flat_begin, ", ", e.flat_end, ") outside the shard");
  e.dtype = stored_dtype(read_attr_str(dset, "dtype"));
  H5Id space(XR_HDF5_ID(H5Dget_space(dset)), H5Sclose);
  const hssize_t points = H5Sget_simple_extent_npoints(space);
  XR_HDF5_CHECK(points);
  H5Id type(XR_HDF5_ID(H5Dget_type(dset)), H5Tclose);
  if (points != e.numel() || H5Tget_size(type) != dtype_size(e.dtype))
    fail(ErrorKind::Checkpoint, "dataset extent or element size disagrees with its attributes");
  if (read_attr_str(dset, "checksum") != "crc32c") fail(ErrorKind::Checkpoint, "unknown checksum kind");
  e.checksum_chunk = read_attr_i64(dset, "checksum_chunk");
  e.checksums = read_attr_u32s(dset, "checksums");
  if (e.checksum_chunk <= 0 || int64_t(e.checksums.size()) != chunks_of(e.numel(), e.checksum_chunk))
    fail(ErrorKind::Checkpoint, "checksum chunks disagree with the extent: ", e.checksums.size(),
         " checksums of chunks of ", e.checksum_chunk, " elements for ", e.numel(), " elements");
  return e;
}

// Stored elements [lo, hi) of entry e, read from the open file with one
// hyperslab widened to whole checksum chunks, each of which is verified.
struct Span {
  std::vector<unsigned char> bytes;
  int64_t begin = 0;  // stored element index of bytes[0]
};
Span read_span(hid_t file, const CheckpointEntry& e, int64_t lo, int64_t hi) {
  const int64_t C = e.checksum_chunk;
  Span s;
  s.begin = lo / C * C;
  // The end of the chunk holding element hi - 1 (hi + C may not fit in 64 bits).
  const int64_t last = hi <= s.begin ? s.begin : (hi - 1) / C * C;
  const int64_t end = hi <= s.begin ? s.begin : last + std::min(C, e.numel() - last);
  const size_t es = dtype_size(e.dtype);
  s.bytes.resize(size_t(end - s.begin) * es);
  H5Id dset(XR_HDF5_ID(H5Dopen2(file, e.dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  H5Id fspace(XR_HDF5_ID(H5Dget_space(dset)), H5Sclose);
  hsize_t start[1] = {hsize_t(s.begin)}, count[1] = {hsize_t(end - s.begin)};
  XR_HDF5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, nullptr, count, nullptr));
  H5Id mspace(XR_HDF5_ID(H5Screate_simple(1, count, nullptr)), H5Sclose);
  const hid_t mtype = e.dtype == DType::F32 ? H5T_NATIVE_FLOAT : e.dtype == DType::F64 ? H5T_NATIVE_DOUBLE
                                                                                       : H5T_NATIVE_UINT16;
  if (end > s.begin) XR_HDF5_CHECK(H5Dread(dset, mtype, mspace, fspace, H5P_DEFAULT, s.bytes.data()));
  for (int64_t b = s.begin; b < end; b += C) {
    const int64_t len = std::min(C, end - b);
    const uint32_t crc = crc32c(s.bytes.data() + size_t(b - s.begin) * es, size_t(len) * es);
    const uint32_t want = e.checksums[size_t(b / C)];
    if (crc != want)
      fail(ErrorKind::Checkpoint, "corrupted: the CRC-32C of stored elements [", b, ", ", b + len, ") is ",
           hex32(crc), ", the file records ", hex32(want));
  }
  return s;
}

// Prefix of every error about one stored entry: names the tensor and the file.
std::string entry_context(const CheckpointEntry& e) {
  return str_cat("checkpoint tensor '", e.name, "' (", e.dataset, ") in ", e.file);
}

H5Id open_file(const std::string& path) {
  return H5Id(XR_HDF5_ID(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)), H5Fclose);
}


// The file of entry e, opened once per rank file and kept in `files`.
hid_t open_cached(std::map<int, H5Id>& files, const CheckpointEntry& e) {
  auto it = files.find(e.rank);
  if (it == files.end()) it = files.emplace(e.rank, open_file(e.file)).first;
  return it->second;
}

// n elements, contiguous both in the wanted range (from out_pos) and in one
// entry's stored elements (from stored_pos).
struct Piece {
  int64_t out_pos, stored_pos, n;
};

void append_piece(std::vector<Piece>& pieces, const Piece& p) {
  Piece* b = pieces.empty() ? nullptr : &pieces.back();
  if (b && b->out_pos + b->n == p.out_pos && b->stored_pos + b->n == p.stored_pos)
    b->n += p.n;  // continues the previous piece
  else
    pieces.push_back(p);
}

struct ReadPlan {
  std::vector<std::vector<Piece>> pieces;  // per stored entry, in the order given
  int64_t missing = -1;                    // a global element no entry holds, or -1
};

// Walks elements [flat_begin, flat_end) of the wanted shard in pieces that
// are contiguous both in the wanted shard and in one stored entry, sticking
// with the entry that served the previous piece (so a replicated tensor is
// read from one rank only). Stops at the first element no entry holds.
ReadPlan plan_read(const std::vector<const CheckpointEntry*>& stored, const ShardMap& want, int64_t flat_begin,
                   int64_t flat_end) {
  std::vector<ShardMap> maps;
  for (const CheckpointEntry* e : stored) maps.emplace_back(e->shard);
  ReadPlan plan;
  plan.pieces.resize(stored.size());
  size_t last = 0;
  for (int64_t i = flat_begin; i < flat_end;) {
    const int64_t g = want.to_global(i);
    const int64_t want_left = std::min(want.run_left(i), flat_end - i);
    bool found = false;
    for (size_t k = 0; k < stored.size() && !found; ++k) {
      const size_t c = (last + k) % stored.size();
      const CheckpointEntry& e = *stored[c];
      const int64_t s = maps[c].to_local(g);
      if (s < e.flat_begin || s >= e.flat_end) continue;
      const int64_t n = std::min({want_left, maps[c].run_left(s), e.flat_end - s});
      append_piece(plan.pieces[c], {i - flat_begin, s - e.flat_begin, n});
      i += n;
      last = c;
      found = true;
    }
    if (!found) {
      plan.missing = g;
      break;
    }
  }
  return plan;
}

// Reads the stored range that entry e's pieces span, as one hyperslab, and
// converts each piece into its place in `out`.
void read_pieces(hid_t file, const CheckpointEntry& e, const std::vector<Piece>& pieces, const Tensor& out) {
  int64_t lo = INT64_MAX, hi = 0;
  for (const Piece& p : pieces) {
    lo = std::min(lo, p.stored_pos);
    hi = std::max(hi, p.stored_pos + p.n);
  }
  const Span span = read_span(file, e, lo, hi);
  const size_t ses = dtype_size(e.dtype), oes = dtype_size(out.dtype());
  for (const Piece& p : pieces)
    convert_elements(span.bytes.data() + size_t(p.stored_pos - span.begin) * ses, e.dtype,
                     static_cast<unsigned char*>(out.raw()) + size_t(p.out_pos) * oes, out.dtype(), p.n);
}

}  // namespace

CheckpointReader CheckpointReader::open(const std::string& step_dir) {
  Hdf5Scope scope;
  CheckpointReader r;
  r.dir_ = step_dir;
  r.meta_ = read_checkpoint_meta(step_dir);
  r.scalars_.resize(r.meta_.rank_files.size());
  for (size_t rank = 0; rank < r.meta_.rank_files.size(); ++rank) {
    const std::string path = (fs::path(step_dir) / r.meta_.rank_files[rank]).string();
    std::string where;  // the entry being indexed, for the error message
    try {
      if (!fs::is_regular_file(path)) fail(ErrorKind::Checkpoint, "the rank file listed in meta.json is missing");
      H5Id f = open_file(path);
      if (read_attr_str(f, "format") != "xirang-checkpoint") fail(ErrorKind::Checkpoint, "not a Xirang rank file");
      const int64_t fr = read_attr_i64(f, "rank"), fs_step = read_attr_i64(f, "step");
      if (fr != int64_t(rank) || fs_step != r.meta_.step)
        fail(ErrorKind::Checkpoint, "holds rank ", fr, " step ", fs_step, ", meta.json expects rank ", rank, " step ",
             r.meta_.step);
      for (const std::string& group : link_names(f)) {
        where = " group /" + group;
        H5Id g(XR_HDF5_ID(H5Gopen2(f, group.c_str(), H5P_DEFAULT)), H5Gclose);
        if (group == "scalars") {
          for (const std::string& key : attr_names(g)) {
            where = " scalar '" + key + "'";
            CheckpointScalar s;
            s.is_int = attr_is_integer(g, key.c_str());
            if (s.is_int) s.i = read_attr_i64(g, key.c_str());
            else s.d = read_attr_f64(g, key.c_str());
            r.scalars_[rank][key] = s;
          }
          continue;
        }
        for (const std::string& ds : link_names(g)) {
          where = " entry /" + group + "/" + ds;
          H5Id d(XR_HDF5_ID(H5Dopen2(g, ds.c_str(), H5P_DEFAULT)), H5Dclose);
          CheckpointEntry e = describe(d, group, ds);
          e.file = path;
          e.rank = int(rank);
          r.entries_.push_back(std::move(e));
        }
      }
    } catch (...) {
      rethrow_as_checkpoint(str_cat("checkpoint file ", path, where));
    }
  }
  std::sort(r.entries_.begin(), r.entries_.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return std::tie(a.group, a.name, a.rank, a.flat_begin) < std::tie(b.group, b.name, b.rank, b.flat_begin);
  });
  for (size_t i = 0; i < r.entries_.size(); ++i) r.index_[{r.entries_[i].group, r.entries_[i].name}].push_back(i);
  return r;
}

CheckpointReader CheckpointReader::open_latest(const std::string& root) {
  const auto dir = CheckpointDir(root).latest();
  if (!dir) fail(ErrorKind::Checkpoint, "no complete checkpoint in ", root);
  return open(*dir);
}

const std::vector<size_t>& CheckpointReader::entries_of(std::string_view group, std::string_view name) const {
  auto it = index_.find({std::string(group), std::string(name)});
  if (it == index_.end())
    fail(ErrorKind::Checkpoint, "checkpoint ", dir_, " has no tensor '", name, "' in group '", group, "'");
  return it->second;
}

bool CheckpointReader::has(std::string_view group, std::string_view name) const {
  return index_.count({std::string(group), std::string(name)}) > 0;
}

Shape CheckpointReader::global_shape(std::string_view group, std::string_view name) const {
  return entries_[entries_of(group, name).front()].shard.global;
}

void CheckpointReader::read(std::string_view group, std::string_view name, const ShardSpec& want, Tensor out) const {
  const std::string problem = shard_spec_problem(want);
  XR_CHECK(problem.empty(), "reading '", name, "': ", problem);
  read(group, name, want, 0, want.local_shape().numel(), out);
}

void CheckpointReader::read(std::string_view group, std::string_view name, const ShardSpec& want,
                            int64_t flat_begin, int64_t flat_end, Tensor out) const {
  const std::string problem = shard_spec_problem(want);
  XR_CHECK(problem.empty(), "reading '", name, "': ", problem);
  const ShardMap wmap(want);
  XR_CHECK(0 <= flat_begin && flat_begin <= flat_end && flat_end <= wmap.numel(), "reading '", name,
           "': flat range [", flat_begin, ", ", flat_end, ") of a shard of ", wmap.numel(), " elements");
  XR_CHECK(out.numel() == flat_end - flat_begin && out.device() == Device::CPU && is_float(out.dtype()),
           "reading '", name, "' into ", out.str(), ": expected ", flat_end - flat_begin, " float elements in host memory");
  std::vector<const CheckpointEntry*> stored;
  for (size_t id : entries_of(group, name)) {
    const CheckpointEntry& e = entries_[id];
    if (e.shard.global != want.global)
      fail(ErrorKind::Checkpoint, "checkpoint tensor '", name, "' has global shape ", e.shard.global.str(),
           ", the model expects ", want.global.str());
    stored.push_back(&e);
  }
  const ReadPlan plan = plan_read(stored, wmap, flat_begin, flat_end);
  if (const int64_t g = plan.missing; g >= 0)
    fail(ErrorKind::Checkpoint, "checkpoint tensor '", name, "' (group '", group, "') is missing global element ", g,
         " ", coords(want.global, g), " of ", want.global.str(), ": no stored entry in ", dir_, " holds it");

  // Per overlapping entry, one hyperslab read of the stored range its pieces
  // span; entries without pieces are never opened.
  Hdf5Scope scope;
  std::map<int, H5Id> files;
  for (size_t c = 0; c < stored.size(); ++c) {
    if (plan.pieces[c].empty()) continue;
    try {
      read_pieces(open_cached(files, *stored[c]), *stored[c], plan.pieces[c], out);
    } catch (...) {
      rethrow_as_checkpoint(entry_context(*stored[c]));
    }
  }
}

bool CheckpointReader::has_scalar(int rank, std::string_view key) const {
  return rank >= 0 && size_t(rank) < scalars_.size() && scalars_[size_t(rank)].count(key) > 0;
}

const std::map<std::string, CheckpointScalar, std::less<>>& CheckpointReader::scalars(int rank) const {
  XR_CHECK(rank >= 0 && size_t(rank) < scalars_.size(), "rank ", rank, " of ", scalars_.size());
  return scalars_[size_t(rank)];
}

int64_t CheckpointReader::get_int(int rank, std::string_view key) const {
  const auto& m = scalars(rank);
  auto it = m.find(key);
  if (it == m.end() || !it->second.is_int)
    fail(ErrorKind::Checkpoint, "checkpoint ", dir_, " rank ", rank, " has no integer scalar '", key, "'");
  return it->second.i;
}

double CheckpointReader::get_double(int rank, std::string_view key) const {
  const auto& m = scalars(rank);
  auto it = m.find(key);
  if (it == m.end() || it->second.is_int)
    fail(ErrorKind::Checkpoint, "checkpoint ", dir_, " rank ", rank, " has no floating-point scalar '", key, "'");
  return it->second.d;
}

std::vector<std::string> CheckpointReader::verify_all() const {
  Hdf5Scope scope;
  std::vector<std::string> problems;
  std::map<int, H5Id> files;
  for (const CheckpointEntry& e : entries_) {
    try {
      const hid_t file = open_cached(files, e);
      // A few chunks at a time bounds the memory for a large tensor.
      const int64_t chunks = std::max<int64_t>(1, (int64_t(16) << 20) / e.checksum_chunk);
      const int64_t step = chunks > INT64_MAX / e.checksum_chunk ? INT64_MAX : e.checksum_chunk * chunks;
      for (int64_t b = 0; b < e.numel(); b += step) read_span(file, e, b, std::min(e.numel(), b + step));
    } catch (const std::exception& ex) {
      problems.push_back(str_cat(entry_context(e), ": ", ex.what()));
    }
  }
  return problems;
}

}  // namespace xirang
