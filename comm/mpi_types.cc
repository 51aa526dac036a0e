#include "comm/mpi_types.h"

#include <algorithm>
#include <mutex>

#include "comm/mpi_check.h"
#include "core/error.h"

namespace xirang {

namespace {

// ---- bf16 / f16: MPI has no 16-bit float types, so they travel as 2 opaque
// bytes and reduce through user-defined ops that compute in float.

inline float to_float(bf16 x) { return bf16_to_float(x); }
inline float to_float(f16 x) { return f16_to_float(x); }
template <class H>
H from_float(float f);
template <>
bf16 from_float<bf16>(float f) { return float_to_bf16(f); }
template <>
f16 from_float<f16>(float f) { return float_to_f16(f); }

struct SumOf {
  float operator()(float a, float b) const { return a + b; }
};
struct MaxOf {
  float operator()(float a, float b) const { return std::max(a, b); }
};

template <class H, class Combine>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = from_float<H>(Combine()(to_float(a[i]), to_float(b[i])));
}

struct HalfTypes {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL, f16 = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum = MPI_OP_NULL, bf16_max = MPI_OP_NULL, f16_sum = MPI_OP_NULL, f16_max = MPI_OP_NULL;
};

// Created once per process (on first use, after MPI_Init) and kept until
// MPI_Finalize releases them: every communicator shares them.
const HalfTypes& half_types() {
  static std::once_flag once;
  static HalfTypes t;
  std::call_once(once, [] {
    HalfTypes h;
    XR_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &h.bf16));
    XR_MPI_CHECK(MPI_Type_commit(&h.bf16));
    XR_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &h.f16));
    XR_MPI_CHECK(MPI_Type_commit(&h.f16));
    XR_MPI_CHECK(MPI_Op_create(&half_reduce<bf16, SumOf>, 1, &h.bf16_sum));
    XR_MPI_CHECK(MPI_Op_create(&half_reduce<bf16, MaxOf>, 1, &h.bf16_max));
    XR_MPI_CHECK(MPI_Op_create(&half_reduce<f16, SumOf>, 1, &h.f16_sum));
    XR_MPI_CHECK(MPI_Op_create(&half_reduce<f16, MaxOf>, 1, &h.f16_max));
    t = h;
  });
  return t;
}

}  // namespace

void create_mpi_types() { half_types(); }

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT;
    case DType::U16: return MPI_UINT16_T;
    case DType::U32: return MPI_UINT32_T;
    case DType::BF16: return half_types().bf16;
    case DType::F16: return half_types().f16;
  }
  fail(ErrorKind::Internal, "mpi_type: unhandled dtype ", int(t));
}

MPI_Op mpi_op(DType t, ReduceOp op) {
  if (t == DType::BF16) return op == ReduceOp::Sum ? half_types().bf16_sum : half_types().bf16_max;
  if (t == DType::F16) return op == ReduceOp::Sum ? half_types().f16_sum : half_types().f16_max;
  return op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
}

}  // namespace xirang
