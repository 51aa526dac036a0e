// comm/mpi_types.h: the MPI datatype and reduction op of each DType. MPI has
// no 16-bit float types, so bf16 and f16 travel as 2 opaque bytes and reduce
// through user-defined ops that add (or take the max) in float. The types and
// ops are created once per process, after MPI_Init, and shared by every
// communicator.
//
//   MPI_Iallreduce(MPI_IN_PLACE, t.raw(), n, mpi_type(t.dtype()), mpi_op(t.dtype(), ReduceOp::Sum), comm, &req);
#pragma once

#include <mpi.h>

#include "comm/communicator.h"
#include "core/dtype.h"

namespace xirang {

// Creates the 16-bit types and ops if they do not exist yet (mpi_type and
// mpi_op also do, on first use).
void create_mpi_types();
MPI_Datatype mpi_type(DType t);
MPI_Op mpi_op(DType t, ReduceOp op);

}  // namespace xirang
