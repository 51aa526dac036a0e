#include "core/dtype.h"

#include <immintrin.h>

#include "core/error.h"

namespace xirang {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::U16: return 2;
    case DType::U32: return 4;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::U16: return "u16";
    case DType::U32: return "u32";
  }
  return "?";
}

DType parse_dtype(std::string_view s, std::string_view where) {
  if (s == "f32" || s == "fp32" || s == "float32") return DType::F32;
  if (s == "f64" || s == "fp64" || s == "float64") return DType::F64;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::F16;
  if (s == "i32" || s == "int32") return DType::I32;
  if (s == "u16" || s == "uint16") return DType::U16;
  if (s == "u32" || s == "uint32") return DType::U32;
  fail(ErrorKind::Config, where, ": unknown dtype '", s, "' (expected fp32, fp64, bf16, fp16, int32, uint16 or uint32)");
}

// The F16C instructions convert with round-to-nearest-even and handle
// subnormals, infinities and NaN, which a hand-written conversion gets wrong easily.
float f16_to_float(f16 x) { return _cvtsh_ss(x.bits); }
f16 float_to_f16(float f) { return f16{uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))}; }

}  // namespace xirang
