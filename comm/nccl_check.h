// comm/nccl_check.h (internal to comm/): the NCCL form of XR_LIB_CHECK, for
// the NCCL calls that do not belong to a communicator (ncclGetUniqueId,
// ncclGetVersion). Calls on a communicator go through NcclState::settle in
// nccl_communicator.cc instead, which also handles ncclInProgress, the
// timeout and the abort.
//
//   XR_NCCL_CHECK(ncclGetUniqueId(&id));
#pragma once

#include <nccl.h>

#include "core/error.h"

#define XR_NCCL_CHECK(call) XR_LIB_CHECK("NCCL", call, rc == ncclSuccess, ncclGetErrorString(rc))
