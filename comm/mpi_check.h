// comm/mpi_check.h (internal to comm/): the MPI form of XR_LIB_CHECK.
//
// Every MPI call of the backend goes through it, so a failing call throws an
// ErrorKind::Library error carrying file:line, the call's text and MPI's own
// message. It only sees failures as return codes on communicators whose
// error handler is MPI_ERRORS_RETURN, which the backend sets on every
// communicator it creates (the default handler aborts the job instead).
//
//   XR_MPI_CHECK(MPI_Comm_dup(parent, &comm));
#pragma once

#include <mpi.h>

#include <string>

#include "core/error.h"

namespace xirang {

// MPI's text for an error code (MPI_Error_string), with the code itself.
std::string mpi_error_string(int code);

}  // namespace xirang

#define XR_MPI_CHECK(call) XR_LIB_CHECK("MPI", call, rc == MPI_SUCCESS, ::xirang::mpi_error_string(rc))
