// core/dtype.h: run-time element types and the 16-bit float conversions.
//
// A tensor's dtype is a run-time value; kernels dispatch on it once, at the
// op boundary, to a template instantiated for the compute type:
//
//   switch (x.dtype()) { case DType::F32: impl<float>(...); break; ... }
//
// BF16 and F16 are storage types: arithmetic happens in float (fp32
// accumulation), conversions round to nearest even.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace xirang {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, U16, U32 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses "f32", "fp32", "float32", "bf16", ...; throws a Config error naming `where` otherwise.
DType parse_dtype(std::string_view s, std::string_view where);
inline bool is_float(DType t) { return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16; }

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{uint16_t(u >> 16)};
}

float f16_to_float(f16 x);
f16 float_to_f16(float f);

}  // namespace xirang
