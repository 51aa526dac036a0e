// Checkpoint plumbing shared by the writer and the reader: HDF5 errors and
// attributes, shard geometry, CRC-32C and element conversion. The step
// directory protocol lives in checkpoint_dir.cc.
#include "runtime/checkpoint/checkpoint_io.h"

#include <algorithm>
#include <cstring>

#include "runtime/checkpoint/hdf5_check.h"

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace xirang {

// ---------------------------------------------------------------------------
// HDF5 errors and attributes

namespace {

herr_t collect_error(unsigned, const H5E_error2_t* e, void* data) {
  auto* out = static_cast<std::string*>(data);
  std::string desc = e->desc ? e->desc : "";
  if (desc.empty()) {
    char buf[256] = {};
    if (H5Eget_msg(e->min_num, nullptr, buf, sizeof buf) > 0) desc = buf;
  }
  if (!out->empty()) *out += "; ";
  *out += (e->func_name ? e->func_name : "?") + std::string(": ") + desc;
  return 0;
}

// Creates attribute `name` on obj, replacing one of that name (set_int twice).
H5Id create_attr(hid_t obj, const char* name, hid_t type, hid_t space) {
  if (XR_HDF5_ID(H5Aexists(obj, name)) > 0) XR_HDF5_CHECK(H5Adelete(obj, name));
  return H5Id(XR_HDF5_ID(H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
}

H5Id vector_space(size_t n) {
  hsize_t dims[1] = {hsize_t(n)};
  return H5Id(XR_HDF5_ID(H5Screate_simple(1, dims, nullptr)), H5Sclose);
}

H5Id open_attr(hid_t obj, const char* name) {
  if (XR_HDF5_ID(H5Aexists(obj, name)) <= 0) fail(ErrorKind::Library, "attribute '", name, "' is missing");
  return H5Id(XR_HDF5_ID(H5Aopen(obj, name, H5P_DEFAULT)), H5Aclose);
}

H5T_class_t attr_class(hid_t attr) {
  H5Id type(XR_HDF5_ID(H5Aget_type(attr)), H5Tclose);
  return H5Tget_class(type);
}

size_t attr_points(hid_t attr) {
  H5Id space(XR_HDF5_ID(H5Aget_space(attr)), H5Sclose);
  hssize_t n = H5Sget_simple_extent_npoints(space);
  XR_HDF5_CHECK(n);
  return size_t(n);
}

template <class T>
std::vector<T> read_attr_vector(hid_t obj, const char* name, hid_t mem_type, H5T_class_t want_class) {
  H5Id attr = open_attr(obj, name);
  if (attr_class(attr) != want_class)
    fail(ErrorKind::Library, "attribute '", name, "' has the wrong type class");
  std::vector<T> v(attr_points(attr));
  if (!v.empty()) XR_HDF5_CHECK(H5Aread(attr, mem_type, v.data()));
  return v;
}

herr_t collect_attr_name(hid_t, const char* name, const H5A_info_t*, void* data) {
  static_cast<std::vector<std::string>*>(data)->push_back(name);
  return 0;
}

}  // namespace

std::string hdf5_error_message() {
  std::string s;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_error, &s);
  H5Eclear2(H5E_DEFAULT);
  // Some messages embed ctime() output, which ends in a newline: our errors are one line.
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s.empty() ? "(HDF5 left no error message)" : s;
}

void rethrow_as_checkpoint(const std::string& context) {
  try {
    throw;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Internal) throw;  // a bug: keep its kind and text
    fail(ErrorKind::Checkpoint, context, ": ", e.what());
  } catch (const std::exception& e) {
    fail(ErrorKind::Checkpoint, context, ": ", e.what());
  }
}

void write_attr_str(hid_t obj, const char* name, const std::string& value) {
  H5Id type(XR_HDF5_ID(H5Tcopy(H5T_C_S1)), H5Tclose);
  XR_HDF5_CHECK(H5Tset_size(type, std::max<size_t>(value.size(), 1)));
  XR_HDF5_CHECK(H5Tset_strpad(type, H5T_STR_NULLPAD));
  H5Id space(XR_HDF5_ID(H5Screate(H5S_SCALAR)), H5Sclose);
  H5Id attr = create_attr(obj, name, type, space);
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  XR_HDF5_CHECK(H5Awrite(attr, type, padded.data()));
}

void write_attr_i64(hid_t obj, const char* name, int64_t value) {
  H5Id space(XR_HDF5_ID(H5Screate(H5S_SCALAR)), H5Sclose);
  H5Id attr = create_attr(obj, name, H5T_STD_I64LE, space);
  XR_HDF5_CHECK(H5Awrite(attr, H5T_NATIVE_INT64, &value));
}

void write_attr_i64s(hid_t obj, const char* name, const std::vector<int64_t>& values) {
  H5Id space = vector_space(values.size());
  H5Id attr = create_attr(obj, name, H5T_STD_I64LE, space);
  if (!values.empty()) XR_HDF5_CHECK(H5Awrite(attr, H5T_NATIVE_INT64, values.data()));
}

void write_attr_f64(hid_t obj, const char* name, double value) {
  H5Id space(XR_HDF5_ID(H5Screate(H5S_SCALAR)), H5Sclose);
  H5Id attr = create_attr(obj, name, H5T_IEEE_F64LE, space);
  XR_HDF5_CHECK(H5Awrite(attr, H5T_NATIVE_DOUBLE, &value));
}

void write_attr_u32s(hid_t obj, const char* name, const std::vector<uint32_t>& values) {
  H5Id space = vector_space(values.size());
  H5Id attr = create_attr(obj, name, H5T_STD_U32LE, space);
  if (!values.empty()) XR_HDF5_CHECK(H5Awrite(attr, H5T_NATIVE_UINT32, values.data()));
}

bool has_attr(hid_t obj, const char* name) { return XR_HDF5_ID(H5Aexists(obj, name)) > 0; }

bool attr_is_integer(hid_t obj, const char* name) { return attr_class(open_attr(obj, name)) == H5T_INTEGER; }

std::string read_attr_str(hid_t obj, const char* name) {
  H5Id attr = open_attr(obj, name);
  H5Id type(XR_HDF5_ID(H5Aget_type(attr)), H5Tclose);
  if (H5Tget_class(type) != H5T_STRING || H5Tis_variable_str(type) > 0)
    fail(ErrorKind::Library, "attribute '", name, "' is not a fixed-length string");
  std::string s(H5Tget_size(type), '\0');
  XR_HDF5_CHECK(H5Aread(attr, type, s.data()));
  s.resize(std::strlen(s.c_str()));  // drop the padding
  return s;
}

int64_t read_attr_i64(hid_t obj, const char* name) {
  auto v = read_attr_vector<int64_t>(obj, name, H5T_NATIVE_INT64, H5T_INTEGER);
  if (v.size() != 1) fail(ErrorKind::Library, "attribute '", name, "' holds ", v.size(), " values, not 1");
  return v[0];
}

std::vector<int64_t> read_attr_i64s(hid_t obj, const char* name) {
  return read_attr_vector<int64_t>(obj, name, H5T_NATIVE_INT64, H5T_INTEGER);
}

double read_attr_f64(hid_t obj, const char* name) {
  auto v = read_attr_vector<double>(obj, name, H5T_NATIVE_DOUBLE, H5T_FLOAT);
  if (v.size() != 1) fail(ErrorKind::Library, "attribute '", name, "' holds ", v.size(), " values, not 1");
  return v[0];
}

std::vector<uint32_t> read_attr_u32s(hid_t obj, const char* name) {
  return read_attr_vector<uint32_t>(obj, name, H5T_NATIVE_UINT32, H5T_INTEGER);
}

std::vector<std::string> attr_names(hid_t obj) {
  std::vector<std::string> names;
  hsize_t idx = 0;
  XR_HDF5_CHECK(H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_INC, &idx, collect_attr_name, &names));
  return names;
}

// ---------------------------------------------------------------------------
// Shard geometry

std::string shard_spec_problem(const ShardSpec& s) {
  const Shape& g = s.global;
  if (g.rank() < 1) return "a tensor of rank 0 (store it with shape (1))";
  for (int i = 0; i < g.rank(); ++i)
    if (g[i] < 0) return str_cat("global shape ", g.str(), " has a negative dimension");
  int64_t numel = 1;
  for (int i = 0; i < g.rank(); ++i)
    if (__builtin_mul_overflow(numel, g[i], &numel))
      return str_cat("global shape ", g.str(), " has more elements than a 64-bit count holds");
  if (s.replicated()) return "";
  if (s.dim >= g.rank()) return str_cat("split dimension ", s.dim, " of a rank-", g.rank(), " tensor");
  if (s.blocks < 1) return str_cat("blocks ", s.blocks, " < 1");
  // At most one block per row (a map of the blocks is built): an empty
  // dimension divides by any count.
  if (s.blocks > std::max<int64_t>(g[s.dim], 1024))
    return str_cat("blocks ", s.blocks, " for dimension ", s.dim, " of global shape ", g.str(),
                   " (expected at most one block per row)");
  if (s.index < 0 || s.index >= s.parts) return str_cat("shard index ", s.index, " outside [0, ", s.parts, ")");
  if (s.block_sizes.empty()) {
    if (g[s.dim] % (int64_t(s.parts) * s.blocks) != 0)
      return str_cat("dimension ", s.dim, " of global shape ", g.str(), " is not divisible by ", s.parts,
                     " parts x ", s.blocks, " blocks");
    return "";
  }
  if (int64_t(s.block_sizes.size()) != s.blocks)
    return str_cat(s.block_sizes.size(), " block sizes for ", s.blocks, " blocks");
  int64_t sum = 0;
  for (int64_t b : s.block_sizes) {
    if (b < 0 || b % s.parts != 0) return str_cat("block of extent ", b, " is not divisible by ", s.parts, " parts");
    if (__builtin_add_overflow(sum, b, &sum))
      return str_cat("block sizes add up to more than dimension ", s.dim, " of global shape ", g.str());
  }
  if (sum != g[s.dim])
    return str_cat("block sizes add up to ", sum, ", dimension ", s.dim, " of global shape ", g.str(), " is ", g[s.dim]);
  return "";
}

ShardMap::ShardMap(const ShardSpec& s) {
  const std::string problem = shard_spec_problem(s);
  XR_CHECK(problem.empty(), problem);
  local_ = s.local_shape();
  numel_ = local_.numel();
  global_numel_ = s.global.numel();
  whole_ = s.replicated();
  if (whole_) {
    run_ = std::max<int64_t>(numel_, 1);
    return;
  }
  for (int i = s.dim + 1; i < s.global.rank(); ++i) inner_ *= s.global[i];
  G_ = s.global[s.dim];
  L_ = G_ / s.parts;
  parts_ = s.parts;
  index_ = s.index;
  int64_t local_begin = 0, global_begin = 0;
  for (int k = 0; k < s.block_count(); ++k) {
    const int64_t gb = s.block_extent(k), lb = gb / s.parts;
    blocks_.push_back({local_begin, lb, global_begin});
    local_begin += lb;
    global_begin += gb;
  }
  equal_ = s.block_sizes.empty();
  lb_ = L_ / s.block_count();
  gb_ = G_ / s.block_count();
  run_ = std::max<int64_t>(lb_ * inner_, 1);  // a zero-sized tensor has no runs; avoid dividing by 0
}

const ShardMap::Block& ShardMap::local_block(int64_t x) const {
  for (const Block& b : blocks_)
    if (x < b.local_begin + b.local_extent) return b;
  return blocks_.back();
}

int64_t ShardMap::run_left(int64_t i) const {
  if (equal_ || whole_) return run_ - i % run_;
  // The run ends with the local block that holds i (all trailing dimensions included).
  const int64_t k = i % inner_, x = (i / inner_) % L_;
  const Block& b = local_block(x);
  return (b.local_begin + b.local_extent - x) * inner_ - k;
}

// Local flat i = ((o * L + x) * inner + k) with x = b * lb + y (block b, row y
// of this part's slice of the block); globally that row sits at b * gb +
// index * lb + y, the same formula as ShardSpec::global_index for any rank.
int64_t ShardMap::to_global(int64_t i) const {
  if (whole_) return i;
  const int64_t k = i % inner_, t = i / inner_;
  const int64_t x = t % L_, o = t / L_;
  if (equal_) return (o * G_ + (x / lb_) * gb_ + index_ * lb_ + x % lb_) * inner_ + k;
  const Block& b = local_block(x);
  return (o * G_ + b.global_begin + index_ * b.local_extent + (x - b.local_begin)) * inner_ + k;
}

int64_t ShardMap::to_local(int64_t g) const {
  if (whole_) return g;
  const int64_t k = g % inner_, t = g / inner_;
  const int64_t gx = t % G_, o = t / G_;
  if (equal_) {
    const int64_t b = gx / gb_, r = gx % gb_;
    if (r / lb_ != index_) return -1;
    return (o * L_ + b * lb_ + r % lb_) * inner_ + k;
  }
  for (const Block& b : blocks_) {
    const int64_t r = gx - b.global_begin;
    if (r < 0 || r >= b.local_extent * parts_) continue;
    if (r / b.local_extent != index_) return -1;
    return (o * L_ + b.local_begin + r % b.local_extent) * inner_ + k;
  }
  return -1;
}

// ---------------------------------------------------------------------------
// CRC-32C and conversions

#if !defined(__SSE4_2__)
namespace {
struct Crc32cTable {
  uint32_t t[256];
  constexpr Crc32cTable() : t{} {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
  }
};
constexpr Crc32cTable kCrcTable;
}  // namespace
#endif

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(__SSE4_2__)
  // The SSE4.2 instruction computes the same CRC-32C as the table below, about 10x faster.
  uint64_t c64 = c;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
  }
  c = uint32_t(c64);
  for (; bytes > 0; --bytes) c = _mm_crc32_u8(c, *p++);
#else
  for (; bytes > 0; --bytes) c = kCrcTable.t[(c ^ *p++) & 0xffu] ^ (c >> 8);
#endif
  return ~c;
}

namespace {

inline double load_el(float x) { return x; }
inline double load_el(double x) { return x; }
inline double load_el(bf16 x) { return bf16_to_float(x); }
inline double load_el(f16 x) { return f16_to_float(x); }

template <class T>
T store_el(double x);
template <> float store_el<float>(double x) { return float(x); }
template <> double store_el<double>(double x) { return x; }
template <> bf16 store_el<bf16>(double x) { return float_to_bf16(float(x)); }
template <> f16 store_el<f16>(double x) { return float_to_f16(float(x)); }

template <class S, class D>
void convert_as(const void* src, void* dst, int64_t n) {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = store_el<D>(load_el(s[i]));
}

template <class S>
void convert_from(const void* src, void* dst, DType to, int64_t n) {
  switch (to) {
    case DType::F32: return convert_as<S, float>(src, dst, n);
    case DType::F64: return convert_as<S, double>(src, dst, n);
    case DType::BF16: return convert_as<S, bf16>(src, dst, n);
    case DType::F16: return convert_as<S, f16>(src, dst, n);
    default: XR_CHECK(false, "checkpoint tensors are float; got ", dtype_name(to));
  }
}

}  // namespace

void convert_elements(const void* src, DType from, void* dst, DType to, int64_t n) {
  if (n <= 0) return;  // empty buffers may be null
  if (from == to) {
    std::memcpy(dst, src, size_t(n) * dtype_size(from));
    return;
  }
  switch (from) {
    case DType::F32: return convert_from<float>(src, dst, to, n);
    case DType::F64: return convert_from<double>(src, dst, to, n);
    case DType::BF16: return convert_from<bf16>(src, dst, to, n);
    case DType::F16: return convert_from<f16>(src, dst, to, n);
    default: XR_CHECK(false, "checkpoint tensors are float; got ", dtype_name(from));
  }
}

}  // namespace xirang
