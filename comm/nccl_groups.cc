#include "comm/nccl_groups.h"

#include <mpi.h>

#include "comm/mpi_check.h"
#include "comm/mpi_runtime.h"
#include "core/error.h"

namespace xirang {

NcclGroups::NcclGroups(ProcessGrid& grid, int device, const NcclStreams& streams, int pp_colors,
                       const CommOptions& opts) {
  if (!streams.compute || !streams.dp)
    fail(ErrorKind::Internal, "NcclGroups: the compute and dp streams must be given (not the legacy stream 0)");
  // The same order on every rank: each set-up waits for the group's other ranks.
  tp_ = make_nccl_group(grid.tp(), device, streams.compute, opts);
  // Attention waits for the gathered keys and values: on the compute stream, as tp.
  cp_ = make_nccl_group(grid.cp(), device, streams.compute, opts);
  dp_grads_ = make_nccl_group(grid.dp_grads(), device, streams.dp, opts);
  dp_grads_->set_input_ready_stream(streams.compute);
  embedding_ = make_nccl_group(grid.embedding(), device, streams.dp, opts);
  embedding_->set_input_ready_stream(streams.compute);
  if (grid.shape().ep > 1) {
    // The layer waits for its tokens: on the compute stream, as tp.
    ep_ = make_nccl_group(grid.ep(), device, streams.compute, opts);
    expert_dp_ = make_nccl_group(grid.expert_dp(), device, streams.dp, opts);
    expert_dp_->set_input_ready_stream(streams.compute);
  }
  for (int i = 0; i < 2 * pp_colors; ++i) pp_streams_.emplace_back(device, StreamPriority::High);
  for (int i = 0; i < 2 * pp_colors; ++i) {
    auto& list = i < pp_colors ? pp_act_ : pp_grads_;
    list.push_back(make_nccl_group(grid.pp(), device, pp_streams_[size_t(i)].get(), opts));
    list.back()->set_input_ready_stream(streams.compute);
  }
  // NCCL connects a pair at its first send or recv and makes that call wait
  // for the peer's; the executor posts receives ahead of sends, so every
  // pipeline channel connects its neighbours now, in the same order on all ranks.
  for (auto* list : {&pp_act_, &pp_grads_})
    for (auto& c : *list) c->connect_neighbours();
}

NcclGroups::~NcclGroups() {
  std::vector<NcclCommunicator*> all = {tp_.get(), cp_.get(), dp_grads_.get(), embedding_.get(), ep_.get(),
                                       expert_dp_.get()};
  for (auto* list : {&pp_act_, &pp_grads_})
    for (auto& c : *list) all.push_back(c.get());
  bool failed = false;
  for (NcclCommunicator* c : all) failed = failed || (c && c->broken());
  if (!failed) return;
  for (NcclCommunicator* c : all)
    if (c) {
      try {
        c->abort("another NCCL channel of this rank failed; shutting down");
      } catch (...) {
        // A destructor has no caller to report to; the channel is released next.
      }
    }
}

std::vector<Communicator*> NcclGroups::pp_act() const {
  std::vector<Communicator*> out;
  for (auto& c : pp_act_) out.push_back(c.get());
  return out;
}

std::vector<Communicator*> NcclGroups::pp_grads() const {
  std::vector<Communicator*> out;
  for (auto& c : pp_grads_) out.push_back(c.get());
  return out;
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
