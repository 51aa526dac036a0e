// Helpers for the multi-rank tests: typed buffers whose contents are a pure
// function of (dtype, seed, rank, index), so every rank can rebuild every
// other rank's input and compute the serial reference locally.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace xirang::test {

// Collectives that hang would otherwise only end at ctest's timeout.
// XIRANG_TEST_BUSY_POLL=1 (ctest's mpi.comm.np*_busy_poll) runs every
// channel with CommOptions::busy_poll On, the other polling path.
inline CommOptions test_options() {
  CommOptions o{.timeout_s = 30};
  const char* busy = std::getenv("XIRANG_TEST_BUSY_POLL");
  if (busy && std::string(busy) == "1") o.busy_poll = BusyPoll::On;
  return o;
}
inline const CommOptions kOpts = test_options();

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Rank `rank`'s input element i: normal values rounded to the dtype, or
// integers in [-1000, -1] U [1, 1000] (never zero, so a missed contribution shows).
inline double input_value(DType dt, uint64_t seed, int rank, int64_t i) {
  double x = rng_normal(seed, uint64_t(rank), uint64_t(i));
  switch (dt) {
    case DType::F32: return double(float(x));
    case DType::F64: return x;
    case DType::BF16: return bf16_to_float(float_to_bf16(float(x)));
    case DType::F16: return f16_to_float(float_to_f16(float(x)));
    case DType::I32: {
      auto v = int64_t(rng_below(seed, uint64_t(rank) + 1000, uint64_t(i), 2000));
      return double(v < 1000 ? v - 1000 : v - 999);
    }
    case DType::U16: return double(rng_below(seed, uint64_t(rank), uint64_t(i), 60000) + 1);
    case DType::U32: return double(rng_below(seed, uint64_t(rank), uint64_t(i), 1u << 30) + 1);
  }
  return 0;
}

// An owned, typed host buffer that reads and writes elements as double.
struct Buf {
  DType dt;
  int64_t n;
  std::vector<uint8_t> bytes;

  Buf(DType dtype, int64_t numel) : dt(dtype), n(numel), bytes(size_t(numel) * dtype_size(dtype) + 1) {}
  Tensor t() { return Tensor(bytes.data(), {n}, dt); }
  Tensor range(int64_t b, int64_t e) { return t().flat_range(b, e); }

  double get(int64_t i) const {
    const uint8_t* p = bytes.data() + size_t(i) * dtype_size(dt);
    switch (dt) {
      case DType::F32: { float v; std::memcpy(&v, p, 4); return v; }
      case DType::F64: { double v; std::memcpy(&v, p, 8); return v; }
      case DType::BF16: { bf16 v; std::memcpy(&v, p, 2); return bf16_to_float(v); }
      case DType::F16: { f16 v; std::memcpy(&v, p, 2); return f16_to_float(v); }
      case DType::I32: { int32_t v; std::memcpy(&v, p, 4); return v; }
      case DType::U16: { uint16_t v; std::memcpy(&v, p, 2); return v; }
      case DType::U32: { uint32_t v; std::memcpy(&v, p, 4); return v; }
    }
    return 0;
  }
  void set(int64_t i, double x) {
    uint8_t* p = bytes.data() + size_t(i) * dtype_size(dt);
    switch (dt) {
      case DType::F32: { float v = float(x); std::memcpy(p, &v, 4); break; }
      case DType::F64: { std::memcpy(p, &x, 8); break; }
      case DType::BF16: { bf16 v = float_to_bf16(float(x)); std::memcpy(p, &v, 2); break; }
      case DType::F16: { f16 v = float_to_f16(float(x)); std::memcpy(p, &v, 2); break; }
      case DType::I32: { int32_t v = int32_t(x); std::memcpy(p, &v, 4); break; }
      case DType::U16: { uint16_t v = uint16_t(x); std::memcpy(p, &v, 2); break; }
      case DType::U32: { uint32_t v = uint32_t(x); std::memcpy(p, &v, 4); break; }
    }
  }
  // Elements [b, e) set to rank `rank`'s input at the same global indices.
  void fill(uint64_t seed, int rank, int64_t b = 0, int64_t e = -1) {
    if (e < 0) e = n;
    for (int64_t i = b; i < e; ++i) set(i, input_value(dt, seed, rank, i));
  }
  // Every element set to a value no collective produces, so a skipped write shows.
  void poison() {
    for (int64_t i = 0; i < n; ++i) set(i, dt == DType::I32 ? -77777 : -12345.0);
  }
};

// The rounding one reduction step adds: each pairwise combination of a
// reduction rounds its result to the dtype once (bf16/f16 ops compute in
// float and round back), so p ranks give p - 1 roundings, each at most half
// an ulp (relative u) of a partial sum no larger than sum |x|. The bound is
// (p - 1) * 2u * sum|x| (2u for slack against the order MPI picks), plus
// f16's subnormal spacing per step. Integer sums are exact.
inline double sum_tolerance(DType dt, int p, double sum_abs) {
  double u = 0, floor = 0;
  switch (dt) {
    case DType::F32: u = std::ldexp(1.0, -24); break;
    case DType::F64: u = std::ldexp(1.0, -53); break;
    case DType::BF16: u = std::ldexp(1.0, -9); break;
    case DType::F16: u = std::ldexp(1.0, -11); floor = std::ldexp(1.0, -24); break;
    default: return 0;
  }
  return (p - 1) * (2 * u * sum_abs + floor);
}

inline const std::vector<DType>& reduce_dtypes() {
  static const std::vector<DType> d{DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32};
  return d;
}

// Runs f and expects an xirang::Error of `kind` whose message holds every part.
inline void expect_error(const std::function<void()>& f, ErrorKind kind, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

}  // namespace xirang::test
