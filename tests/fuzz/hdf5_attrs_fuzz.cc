// Fuzz target: the attributes of a checkpoint rank file's tensor entries
// (runtime/checkpoint/checkpoint_reader.cc describe(): name, global_shape,
// local_shape, dtype, split_dim, parts, index, blocks, block_sizes,
// flat_begin, flat_end, checksum, checksum_chunk, checksums) and of its
// scalars, which CheckpointReader trusts once they pass its checks. What is
// fuzzed is that trust, not HDF5's own file parser: the input chooses the
// entries and their attribute values, types and counts, and this target
// writes them with the HDF5 C API into a well-formed rank file of a
// one-rank checkpoint; then the reader opens the step, reads every tensor
// whole and shard by shard, and verifies every entry. Anything but success
// or a xirang::Error fails.
//
// Input layout (every field is read from the front; a missing byte reads 0,
// so the empty input is one valid entry and every prefix is meaningful):
//   u8 layout: entries = 1 + layout % 4; bit 0x10: all entries are shards
//      of one tensor (indices 0, 1, ... of the first entry's split)
//   per entry:
//     u32 overrides: bit k replaces attribute k below by fuzzed bytes
//     u8 rank-1, rank x u8 dims, u8 mode (whole, split, blocks, block_sizes),
//     u8 dim, u8 parts-1, u8 index, u8 blocks-1, u8 dtype, u8 piece,
//     u8 checksum_chunk-1, then the override values in bit order
//   u8 scalar kind (int, double, string, two ints, none)
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/checkpoint/hdf5_check.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace fs = std::filesystem;
using namespace xirang;

std::string step_dir;  // a committed one-rank step whose rank file each input replaces

struct Bytes {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(u8()) << (8 * i);
    return v;
  }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(u8()) << (8 * i);
    return v;
  }
  int64_t i64() { return int64_t(u64()); }
  std::string str() {
    std::string s(u8() % 24, '\0');
    for (char& c : s) c = char(u8());
    return s;
  }
  std::vector<int64_t> i64s() {
    std::vector<int64_t> v(u8() % 9);
    for (int64_t& x : v) x = i64();
    return v;
  }
};

enum Attr {
  kName, kGlobal, kLocal, kDtype, kSplitDim, kParts, kIndex, kBlocks, kBlockSizes, kFlatBegin, kFlatEnd,
  kChecksum, kChecksumChunk, kChecksums, kExtent, kElemType, kMissing, kWrongClass, kCount
};

const char* const kAttrNames[] = {"name",       "global_shape", "local_shape", "dtype",    "split_dim",
                                  "parts",      "index",        "blocks",      "block_sizes", "flat_begin",
                                  "flat_end",   "checksum",     "checksum_chunk", "checksums"};
constexpr int kNamedAttrs = 14;

// Element count of a shape, or -1 when a dimension is negative or the product exceeds `limit`.
int64_t small_numel(const Shape& s, int64_t limit) {
  int64_t n = 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (s[i] < 0) return -1;
    if (s[i] == 0) return 0;
  }
  for (int i = 0; i < s.rank(); ++i) {
    if (s[i] > limit / n) return -1;
    n *= s[i];
  }
  return n;
}

void write_i64s_as(hid_t obj, const char* name, const std::vector<int64_t>& v, int wrong) {
  switch (wrong) {
    case 1: write_attr_f64(obj, name, v.empty() ? 0.5 : double(v[0])); break;
    case 2: write_attr_str(obj, name, "12"); break;
    case 3: {
      std::vector<uint32_t> u;
      for (int64_t x : v) u.push_back(uint32_t(x));
      write_attr_u32s(obj, name, u);
      break;
    }
    default: write_attr_i64s(obj, name, v);
  }
}

// One entry: a valid description from the shape choices, then the overrides.
void write_entry(hid_t group, Bytes& in, int k, bool one_tensor, const ShardSpec* shared, ShardSpec* first) {
  const uint32_t over = in.u32();
  ShardSpec s;
  if (shared) {
    s = *shared;
    s.index = k % std::max(1, s.parts);
  } else {
    Shape g;
    const int rank = 1 + in.u8() % 3;
    for (int i = 0; i < rank; ++i) g.push_back(1 + in.u8() % 6);
    const int mode = in.u8() % 4, dim = in.u8() % rank, parts = 1 + in.u8() % 4;
    s = ShardSpec::whole(g);
    if (mode > 0) {
      const int index = in.u8() % parts, blocks = mode >= 2 ? 1 + in.u8() % 3 : 1;
      if (mode == 3) {
        std::vector<int64_t> sizes;
        int64_t sum = 0;
        for (int b = 0; b < blocks; ++b) sum += sizes.emplace_back(int64_t(parts) * (in.u8() % 3));
        g[dim] = sum;
        s = ShardSpec::split_blocks(g, dim, parts, index, sizes);
      } else {
        g[dim] = int64_t(parts) * blocks * (1 + in.u8() % 3);
        s = ShardSpec::split(g, dim, parts, index, blocks);
      }
      if (s.replicated()) s = ShardSpec::whole(g);
    }
  }
  if (first) *first = s;
  const Shape local = s.local_shape();
  const int64_t local_n = local.numel();
  const DType dtypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16};
  const DType dtype = dtypes[in.u8() % 4];
  int64_t fb = 0, fe = local_n;
  switch (in.u8() % 3) {
    case 1: fe = local_n / 2; break;
    case 2: fb = local_n / 2; break;
    default: break;
  }
  int64_t chunk = 1 + in.u8() % 8;
  const int64_t n = fe - fb;

  // The stored elements: distinct values in the stored dtype, and their CRCs.
  const size_t es = dtype_size(dtype);
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[size_t(i)] = 0.25f * float(fb + i + 1) + float(k);
  std::vector<unsigned char> stored(size_t(n) * es);
  if (n > 0) convert_elements(values.data(), DType::F32, stored.data(), dtype, n);
  std::vector<uint32_t> crcs;
  for (int64_t b = 0; b < n; b += chunk)
    crcs.push_back(crc32c(stored.data() + size_t(b) * es, size_t(std::min(chunk, n - b)) * es));

  // Attribute values, as the writer would store them, then the fuzzed ones.
  std::string name = one_tensor ? "t" : "t" + std::to_string(k), dtype_str = dtype_name(dtype), kind = "crc32c";
  std::vector<int64_t> global_v, local_v, ints(kCount, 0), sizes = s.block_sizes;
  for (int i = 0; i < s.global.rank(); ++i) global_v.push_back(s.global[i]);
  for (int i = 0; i < local.rank(); ++i) local_v.push_back(local[i]);
  ints[kSplitDim] = s.dim;
  ints[kParts] = s.parts;
  ints[kIndex] = s.index;
  ints[kBlocks] = s.block_count();
  ints[kFlatBegin] = fb;
  ints[kFlatEnd] = fe;
  ints[kChecksumChunk] = chunk;
  uint64_t extent = uint64_t(n);
  int elem_type = 0, missing = -1, wrong = -1, wrong_kind = 0;
  for (int a = 0; a < kCount; ++a) {
    if (!(over >> a & 1)) continue;
    switch (a) {
      case kName: name = in.str(); break;
      case kGlobal: global_v = in.i64s(); break;
      case kLocal: local_v = in.i64s(); break;
      case kDtype: dtype_str = in.str(); break;
      case kBlockSizes: sizes = in.i64s(); break;
      case kChecksum: kind = in.str(); break;
      case kChecksums: {
        crcs.resize(in.u8() % 12);
        for (uint32_t& c : crcs) c = in.u32();
        break;
      }
      case kExtent: extent = in.u8() % 64; break;
      case kElemType: elem_type = in.u8() % 7; break;
      case kMissing: missing = in.u8() % kNamedAttrs; break;
      case kWrongClass: wrong = in.u8() % kNamedAttrs, wrong_kind = 1 + in.u8() % 3; break;
      default: ints[size_t(a)] = in.i64(); break;
    }
  }

  const hid_t ftypes[] = {H5T_IEEE_F32LE, H5T_IEEE_F64LE, H5T_STD_U16LE, H5T_STD_U16LE,
                          H5T_STD_I16LE,  H5T_STD_I32LE,  H5T_STD_U8LE};
  hid_t ftype = ftypes[elem_type];
  if (elem_type == 0) ftype = dtype == DType::F32 ? H5T_IEEE_F32LE : dtype == DType::F64 ? H5T_IEEE_F64LE : H5T_STD_U16LE;
  // A two-dimensional extent when the elem_type choice says so (the reader selects one-dimensional hyperslabs).
  hsize_t dims[2] = {hsize_t(extent), 1};
  const int ds_rank = elem_type == 3 ? 2 : 1;
  H5Id space(XR_HDF5_ID(H5Screate_simple(ds_rank, dims, nullptr)), H5Sclose);
  const std::string ds_name = "e" + std::to_string(k);
  H5Id dset(XR_HDF5_ID(H5Dcreate2(group, ds_name.c_str(), ftype, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)),
            H5Dclose);
  // The stored bytes when their size matches the extent (else the dataset keeps its fill value).
  const hid_t mtype = dtype == DType::F32 ? H5T_NATIVE_FLOAT : dtype == DType::F64 ? H5T_NATIVE_DOUBLE : H5T_NATIVE_UINT16;
  if (extent == uint64_t(n) && n > 0 && H5Tget_size(ftype) == es)
    XR_HDF5_CHECK(H5Dwrite(dset, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, stored.data()));

  for (int a = 0; a < kNamedAttrs; ++a) {
    if (a == missing || (a == kBlockSizes && sizes.empty() && !(over >> kBlockSizes & 1))) continue;
    const char* an = kAttrNames[a];
    const int w = a == wrong ? wrong_kind : 0;
    switch (a) {
      case kName: w ? write_attr_i64(dset, an, 7) : write_attr_str(dset, an, name); break;
      case kDtype: w ? write_attr_i64(dset, an, 2) : write_attr_str(dset, an, dtype_str); break;
      case kChecksum: w ? write_attr_f64(dset, an, 1.0) : write_attr_str(dset, an, kind); break;
      case kGlobal: write_i64s_as(dset, an, global_v, w); break;
      case kLocal: write_i64s_as(dset, an, local_v, w); break;
      case kBlockSizes: write_i64s_as(dset, an, sizes, w); break;
      case kChecksums:
        if (w) write_i64s_as(dset, an, {1, 2}, w == 3 ? 1 : w);
        else write_attr_u32s(dset, an, crcs);
        break;
      default:
        // One value, or (wrong kind 3) two values of the right class.
        write_i64s_as(dset, an, w == 3 ? std::vector<int64_t>{ints[size_t(a)], 1} : std::vector<int64_t>{ints[size_t(a)]},
                      w == 3 ? 0 : w);
    }
  }
}

void write_rank_file(const std::string& path, Bytes in) {
  Hdf5Scope scope;
  H5Id f(XR_HDF5_ID(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
  write_attr_str(f, "format", "xirang-checkpoint");
  write_attr_i64(f, "format_version", kCheckpointFormatVersion);
  write_attr_i64(f, "rank", 0);
  write_attr_i64(f, "step", 1);
  const uint8_t layout = in.u8();
  const int entries = 1 + layout % 4;
  ShardSpec first;
  {
    H5Id g(XR_HDF5_ID(H5Gcreate2(f, "params", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Gclose);
    for (int k = 0; k < entries; ++k)
      write_entry(g, in, k, layout & 0x10, (layout & 0x10) && k > 0 ? &first : nullptr, k == 0 ? &first : nullptr);
  }
  H5Id sc(XR_HDF5_ID(H5Gcreate2(f, "scalars", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Gclose);
  switch (in.u8() % 5) {
    case 0: write_attr_i64(sc, "data.position", 12); break;
    case 1: write_attr_f64(sc, "loss_scale", 1024.0); break;
    case 2: write_attr_str(sc, "odd", "x"); break;
    case 3: write_attr_i64s(sc, "two", {1, 2}); break;
    default: break;
  }
  f.close();
}

// Reads tensor `name` into a host buffer for shard `want`, when that is small.
void read_shard(const CheckpointReader& r, const std::string& name, const ShardSpec& want) {
  if (!shard_spec_problem(want).empty()) return;
  const int64_t n = small_numel(want.local_shape(), int64_t(1) << 16);
  if (n < 0) return;
  std::vector<float> buf(size_t(std::max<int64_t>(n, 1)));
  r.read("params", name, want, Tensor(buf.data(), Shape({n}), DType::F32));
  if (n >= 2) {
    std::vector<double> half(size_t(n / 2));
    r.read("params", name, want, n / 2, n / 2 + int64_t(half.size()), Tensor(half.data(), Shape({n / 2}), DType::F64));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const fs::path root = fs::temp_directory_path() / ("xirang_fuzz_h5." + std::to_string(::getpid()));
  fs::remove_all(root);
  CheckpointDir dir(root.string());
  {
    const std::string tmp = dir.prepare(1);
    RankCheckpointWriter w(tmp, 0, 1);
    w.close();
  }
  CheckpointMeta meta;
  meta.step = 1;
  dir.commit(meta, 0);
  step_dir = dir.step_dir(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = step_dir + "/" + rank_file_name(0);
  write_rank_file(path, Bytes{data, size});
  fuzz::expect_errors([&] {
    // XIRANG_FUZZ_VERBOSE=1: say why an input is refused (to check that the seeds load).
    const CheckpointReader r = [&] {
      try {
        return CheckpointReader::open(step_dir);
      } catch (const Error& e) {
        if (std::getenv("XIRANG_FUZZ_VERBOSE")) std::fprintf(stderr, "refused: %s\n", e.what());
        throw;
      }
    }();
    std::map<std::string, std::vector<const CheckpointEntry*>> by_name;
    for (const CheckpointEntry& e : r.entries()) by_name[e.name].push_back(&e);
    for (const auto& kv : by_name) {
      const std::string& name = kv.first;  // a plain variable: clang before 16 cannot capture a binding
      // The whole tensor, as a single-rank layout reads it, then each stored shard and its neighbour.
      fuzz::expect_errors([&] { read_shard(r, name, ShardSpec::whole(r.global_shape("params", name))); });
      for (const CheckpointEntry* e : kv.second) {
        fuzz::expect_errors([&] { read_shard(r, name, e->shard); });
        ShardSpec other = e->shard;
        other.index = e->shard.parts > 1 ? (e->shard.index + 1) % e->shard.parts : 0;
        fuzz::expect_errors([&] { read_shard(r, name, other); });
      }
    }
    for (const std::string& p : r.verify_all()) (void)p;
    for (const auto& [key, s] : r.scalars(0)) {
      if (s.is_int) (void)r.get_int(0, key);
      else (void)r.get_double(0, key);
    }
  });
  return 0;
}
