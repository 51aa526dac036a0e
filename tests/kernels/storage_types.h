// tests/kernels/storage_types.h: the element types a kernel test runs over,
// and the checks that differ by type.
//
// One typed suite per op family covers every storage type the op takes:
// f64 (the exact path, compared with the float64 reference to 1e-10), f32,
// and the 16-bit storage types bf16 and f16 (inputs rounded to the type
// first, float arithmetic, one rounding on store). Each test file states its
// tolerances once, in a table by type, justified from the float64 reference.
//
//   template <class T> class GeluTest : public ::testing::Test {};
//   TYPED_TEST_SUITE(GeluTest, StorageTypes, StorageTypeNames);  // GeluTest/bf16.Forward
//   TYPED_TEST(GeluTest, Forward) {
//     using T = TypeParam;
//     ...
//     expect_stored(y, ref, Tol<T>::gelu, 0.97, "gelu y");
//   }
//
// Suites with a second axis (attention's head layout) are value-parameterised
// on the DType and reach the template through with_storage_type().
#pragma once

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <type_traits>

#include "tests/kernels/reference.h"

namespace xirang {
// A DType test parameter prints as its name ("bf16"), not as a byte.
inline void PrintTo(DType t, std::ostream* os) { *os << dtype_name(t); }
}  // namespace xirang

namespace xirang::test {

using StorageTypes = ::testing::Types<double, float, bf16, f16>;

template <class T>
constexpr const char* storage_name() {
  if constexpr (std::is_same_v<T, double>) return "f64";
  else if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, bf16>) return "bf16";
  else return "f16";
}

// Test names by type (LayerNormTest/bf16.Forward), not by position.
struct StorageTypeNames {
  template <class T>
  static std::string GetName(int) {
    return storage_name<T>();
  }
};

// The type that holds statistics and losses beside activations of type T:
// F32 for the 16-bit types, T itself otherwise.
template <class T>
using StatType = std::conditional_t<is_16bit_v<T>, float, T>;

// The tolerance of an output stored as T, relative to max(1, max|ref|):
// `wide` for f32 (each test justifies its own), 1e-10 for f64 (tol() in
// reference.h), `units` unit roundoffs for the 16-bit types.
template <class T>
constexpr double stored_tol(double wide, double units) {
  if constexpr (is_16bit_v<T>) return units * unit_roundoff<T>();
  else return tol<T>(wide);
}

// expect_near, and for a 16-bit output also that at least `min_rounded` of
// its elements equal the reference rounded once (reference.h): an op that
// rounds an intermediate to 16 bits passes the first check but not this one.
template <class T>
void expect_stored(const std::vector<T>& got, const Vec& ref, double rel, double min_rounded, const std::string& what) {
  expect_near(got, ref, rel, what);
  if constexpr (is_16bit_v<T>) expect_mostly_rounded(got, ref, min_rounded, what);
}

// Calls f.template operator()<T>() with the C++ type of a float DType.
template <class F>
void with_storage_type(DType t, F&& f) {
  switch (t) {
    case DType::F64: f.template operator()<double>(); break;
    case DType::F32: f.template operator()<float>(); break;
    case DType::BF16: f.template operator()<bf16>(); break;
    case DType::F16: f.template operator()<f16>(); break;
    default: ADD_FAILURE() << "not a float storage type: " << dtype_name(t);
  }
}

}  // namespace xirang::test
