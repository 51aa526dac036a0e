#include "comm/nccl_groups.h"

#include <mpi.h>

#include "comm/mpi_check.h"
#include "comm/mpi_runtime.h"
#include "core/error.h"

namespace xirang {

NcclGroups::NcclGroups(ProcessGrid& grid, int device, const NcclStreams& streams, const CommOptions& opts) {
  if (!streams.compute || !streams.dp || !streams.pp)
    fail(ErrorKind::Internal, "NcclGroups: the compute, dp and pp streams must all be given (not the legacy stream 0)");
  // The same order on every rank: each set-up waits for the group's other ranks.
  tp_ = make_nccl_group(grid.tp(), device, streams.compute, opts);
  dp_grads_ = make_nccl_group(grid.dp_grads(), device, streams.dp, opts);
  dp_grads_->set_input_ready_stream(streams.compute);
  embedding_ = make_nccl_group(grid.embedding(), device, streams.dp, opts);
  embedding_->set_input_ready_stream(streams.compute);
  pp_ = make_nccl_group(grid.pp(), device, streams.pp, opts);
  pp_->set_input_ready_stream(streams.compute);
}

int node_local_device() {
  int count = 0;
  cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0)
    fail(ErrorKind::Comm, "no CUDA device is visible (", rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices", ")");
  if (!MpiRuntime::active()) return 0;
  MPI_Comm node = MPI_COMM_NULL;
  XR_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int local = 0;
  int rc_rank = MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  XR_MPI_CHECK(rc_rank);
  return local % count;
}

}  // namespace xirang
