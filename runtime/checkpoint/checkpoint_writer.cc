// RankCheckpointWriter: one rank's HDF5 file of self-describing tensor
// entries and named scalars (format: docs/checkpoint_format.md).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <type_traits>

#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/checkpoint/hdf5_check.h"

namespace xirang {

namespace fs = std::filesystem;

// The handles live in the header as int64_t so that it need not include hdf5.h.
static_assert(std::is_same_v<hid_t, int64_t>, "hid_t is 64-bit since HDF5 1.10");

namespace {

// Group and entry names become HDF5 link names: one path component each.
// "scalars" is the group of the per-rank values.
void check_component(std::string_view what, std::string_view s) {
  XR_CHECK(!s.empty() && s != "." && s != ".." && s.find('/') == std::string_view::npos,
           "checkpoint ", what, " '", s, "' must be a non-empty name without '/'");
}

// Stored dtypes: the file type (little-endian, fixed size) and the matching
// memory type. 16-bit floats are stored as uint16 bit patterns; the entry's
// dtype attribute says which kind.
hid_t file_type(DType t) {
  switch (t) {
    case DType::F32: return H5T_IEEE_F32LE;
    case DType::F64: return H5T_IEEE_F64LE;
    case DType::BF16:
    case DType::F16: return H5T_STD_U16LE;
    default: XR_CHECK(false, "a checkpoint stores f32, f64, bf16 or f16, not ", dtype_name(t));
  }
  return -1;
}

hid_t memory_type(DType t) {
  switch (t) {
    case DType::F32: return H5T_NATIVE_FLOAT;
    case DType::F64: return H5T_NATIVE_DOUBLE;
    default: return H5T_NATIVE_UINT16;
  }
}

H5Id open_or_create_group(hid_t file, const std::string& name) {
  if (XR_HDF5_ID(H5Lexists(file, name.c_str(), H5P_DEFAULT)) > 0)
    return H5Id(XR_HDF5_ID(H5Gopen2(file, name.c_str(), H5P_DEFAULT)), H5Gclose);
  return H5Id(XR_HDF5_ID(H5Gcreate2(file, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Gclose);
}

std::vector<int64_t> dims_of(const Shape& s) {
  std::vector<int64_t> v;
  for (int i = 0; i < s.rank(); ++i) v.push_back(s[i]);
  return v;
}


// The checks of add(): names usable as HDF5 links, a valid shard, and a flat
// range inside it that `data` (host memory, a float dtype) holds exactly.
void check_entry(std::string_view group, std::string_view name, const ShardSpec& shard, int64_t flat_begin,
                 int64_t flat_end, const Tensor& data, DType store_as) {
  check_component("group", group);
  check_component("tensor name", name);
  XR_CHECK(group != "scalars", "the checkpoint group 'scalars' is reserved for set_int/set_double");
  const std::string problem = shard_spec_problem(shard);
  XR_CHECK(problem.empty(), "checkpoint entry '", name, "': ", problem);
  const int64_t local_numel = shard.local_shape().numel();
  XR_CHECK(0 <= flat_begin && flat_begin <= flat_end && flat_end <= local_numel, "checkpoint entry '", name,
           "': flat range [", flat_begin, ", ", flat_end, ") of a local shard of ", local_numel, " elements");
  const int64_t n = flat_end - flat_begin;
  XR_CHECK(data.numel() == n, "checkpoint entry '", name, "': data ", data.str(), " holds ", data.numel(),
           " elements, the range ", n);
  XR_CHECK(data.device() == Device::CPU, "checkpoint entry '", name, "': data must be in host memory");
  XR_CHECK(is_float(data.dtype()) && is_float(store_as), "checkpoint entry '", name, "': float dtypes only");
}

// The stored bytes: the data itself, or its conversion to store_as (kept in `converted`).
const void* stored_bytes(const Tensor& data, DType store_as, std::vector<unsigned char>& converted) {
  if (store_as == data.dtype()) return data.raw();
  converted.resize(size_t(data.numel()) * dtype_size(store_as));
  convert_elements(data.raw(), data.dtype(), converted.data(), store_as, data.numel());
  return converted.data();
}

// One CRC per chunk of elements, so a reader that needs part of an entry
// verifies only the chunks it reads.
std::vector<uint32_t> chunk_checksums(const void* bytes, int64_t n, size_t es, int64_t chunk) {
  std::vector<uint32_t> crcs;
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t len = std::min(chunk, n - b);
    crcs.push_back(crc32c(static_cast<const unsigned char*>(bytes) + size_t(b) * es, size_t(len) * es));
  }
  return crcs;
}

// A one-dimensional dataset of n elements stored as `dtype`, holding `bytes`.
// Contiguous layout (the default): a byte range per dataset, which a reader
// can take a hyperslab of cheaply (and a test can corrupt).
H5Id write_dataset(hid_t group, const std::string& name, DType dtype, int64_t n, const void* bytes) {
  hsize_t dims[1] = {hsize_t(n)};
  H5Id space(XR_HDF5_ID(H5Screate_simple(1, dims, nullptr)), H5Sclose);
  H5Id dset(XR_HDF5_ID(H5Dcreate2(group, name.c_str(), file_type(dtype), space, H5P_DEFAULT, H5P_DEFAULT,
                                  H5P_DEFAULT)),
            H5Dclose);
  if (n > 0) XR_HDF5_CHECK(H5Dwrite(dset, memory_type(dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes));
  return dset;
}

// The attributes that make an entry describe itself (the reader's describe() checks them).
void write_entry_attrs(hid_t dset, const CheckpointEntry& e) {
  write_attr_str(dset, "name", e.name);
  write_attr_i64s(dset, "global_shape", dims_of(e.shard.global));
  write_attr_i64s(dset, "local_shape", dims_of(e.local));
  write_attr_str(dset, "dtype", dtype_name(e.dtype));
  write_attr_i64(dset, "split_dim", e.shard.dim);
  write_attr_i64(dset, "parts", e.shard.parts);
  write_attr_i64(dset, "index", e.shard.index);
  write_attr_i64(dset, "blocks", e.shard.block_count());
  if (!e.shard.block_sizes.empty()) write_attr_i64s(dset, "block_sizes", e.shard.block_sizes);
  write_attr_i64(dset, "flat_begin", e.flat_begin);
  write_attr_i64(dset, "flat_end", e.flat_end);
  write_attr_str(dset, "checksum", "crc32c");
  write_attr_i64(dset, "checksum_chunk", e.checksum_chunk);
  write_attr_u32s(dset, "checksums", e.checksums);
}

}  // namespace

RankCheckpointWriter::RankCheckpointWriter(const std::string& step_dir, int rank, int64_t step,
                                           CheckpointWriterOptions options)
    : dir_(step_dir), rank_(rank), step_(step), opt_(options) {
  XR_CHECK(rank >= 0, "rank ", rank);
  XR_CHECK(opt_.checksum_chunk > 0, "checksum_chunk ", opt_.checksum_chunk);
  path_ = (fs::path(dir_) / rank_file_name(rank)).string();
  tmp_path_ = path_ + ".tmp";
  Hdf5Scope scope;
  try {
    fs::create_directories(dir_);
    H5Id f(XR_HDF5_ID(H5Fcreate(tmp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
    write_attr_str(f, "format", "xirang-checkpoint");
    write_attr_i64(f, "format_version", kCheckpointFormatVersion);
    write_attr_i64(f, "rank", rank);
    write_attr_i64(f, "step", step);
    H5Id g(XR_HDF5_ID(H5Gcreate2(f, "scalars", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Gclose);
    scalars_ = g.release();
    file_ = f.release();
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp_path_, ec);
    rethrow_as_checkpoint(str_cat("cannot create checkpoint file ", tmp_path_));
  }
}

RankCheckpointWriter::~RankCheckpointWriter() {
  if (file_ >= 0) abandon();
}

void RankCheckpointWriter::abandon() noexcept {
  Hdf5Scope scope;
  if (scalars_ >= 0) H5Gclose(scalars_);
  if (file_ >= 0) H5Fclose(file_);
  scalars_ = file_ = -1;
  std::remove(tmp_path_.c_str());
}

void RankCheckpointWriter::add(std::string_view group, std::string_view name, const ShardSpec& shard,
                               const Tensor& data) {
  const std::string problem = shard_spec_problem(shard);
  XR_CHECK(problem.empty(), "checkpoint entry '", name, "': ", problem);
  add(group, name, shard, 0, shard.local_shape().numel(), data, data.dtype());
}

void RankCheckpointWriter::add(std::string_view group, std::string_view name, const ShardSpec& shard_in,
                               int64_t flat_begin, int64_t flat_end, const Tensor& data, DType store_as) {
  XR_CHECK(file_ >= 0, "add() on a closed checkpoint writer");
  check_entry(group, name, shard_in, flat_begin, flat_end, data, store_as);
  CheckpointEntry e;
  e.group = std::string(group);
  e.name = std::string(name);
  // Canonical form of a replicated shard, so files compare equal whatever the caller passed.
  e.shard = shard_in.replicated() ? ShardSpec::whole(shard_in.global) : shard_in;
  e.local = e.shard.local_shape();
  e.flat_begin = flat_begin;
  e.flat_end = flat_end;
  e.dtype = store_as;
  e.checksum_chunk = opt_.checksum_chunk;
  // A piece of a shard (ZeRO) is named by where it starts, so that one file
  // may hold several pieces of the same tensor.
  const bool whole = flat_begin == 0 && flat_end == e.local.numel();
  const std::string ds_name = whole ? e.name : str_cat(e.name, "@", flat_begin);
  Hdf5Scope scope;
  try {
    H5Id g = open_or_create_group(file_, e.group);
    if (XR_HDF5_ID(H5Lexists(g, ds_name.c_str(), H5P_DEFAULT)) > 0)
      fail(ErrorKind::Checkpoint, "duplicate checkpoint entry /", e.group, "/", ds_name);
    std::vector<unsigned char> converted;
    const void* bytes = stored_bytes(data, store_as, converted);
    e.checksums = chunk_checksums(bytes, e.numel(), dtype_size(store_as), e.checksum_chunk);
    H5Id dset = write_dataset(g, ds_name, store_as, e.numel(), bytes);
    write_entry_attrs(dset, e);
  } catch (...) {
    rethrow_as_checkpoint(str_cat("writing tensor '", e.name, "' (group '", e.group, "') to ", tmp_path_));
  }
}

void RankCheckpointWriter::set_int(std::string_view key, int64_t value) {
  XR_CHECK(file_ >= 0 && !key.empty(), "set_int('", key, "') on a closed writer or with an empty key");
  Hdf5Scope scope;
  try {
    write_attr_i64(scalars_, std::string(key).c_str(), value);
  } catch (...) {
    rethrow_as_checkpoint(str_cat("writing scalar '", key, "' to ", tmp_path_));
  }
}

void RankCheckpointWriter::set_double(std::string_view key, double value) {
  XR_CHECK(file_ >= 0 && !key.empty(), "set_double('", key, "') on a closed writer or with an empty key");
  Hdf5Scope scope;
  try {
    write_attr_f64(scalars_, std::string(key).c_str(), value);
  } catch (...) {
    rethrow_as_checkpoint(str_cat("writing scalar '", key, "' to ", tmp_path_));
  }
}

void RankCheckpointWriter::close() {
  XR_CHECK(file_ >= 0, "close() on a closed checkpoint writer");
  Hdf5Scope scope;
  try {
    H5Id g(scalars_, H5Gclose);
    scalars_ = -1;
    g.close();
    H5Id f(file_, H5Fclose);
    file_ = -1;
    f.close();  // every object is closed, so this really closes (and flushes) the file
    // Only a synced, complete file gets the final name: commit() trusts it.
    sync_path(tmp_path_, false);
    fs::rename(tmp_path_, path_);
    sync_path(dir_, true);
  } catch (...) {
    abandon();
    rethrow_as_checkpoint(str_cat("cannot finish checkpoint file ", path_));
  }
}

}  // namespace xirang
