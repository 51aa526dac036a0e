// comm/nccl_groups.h: NCCL channels for the device traffic of a
// ProcessGrid's groups (builds with CUDA and NCCL only: XIRANG_HAVE_NCCL).
//
// The grid keeps its MPI (or local) communicators for host traffic: scalar
// reductions of the loss and the norm, barriers, set-up. NcclGroups adds one
// NcclCommunicator per group whose tensors live on the device, each on the
// stream its traffic belongs to:
//
//   group      stream    fed by (input-ready)  carries
//   tp         compute   compute (itself)      activations, the loss phases
//   dp_grads   dp        compute               gradient buckets, ZeRO gathers
//   embedding  dp        compute               the tied token table's gradient
//   pp         pp        compute               activations and their gradients
//
// Every rank must create it at the same point, since each channel's set-up
// is collective over its group (and bootstraps over the grid's channel of the
// same group). A group of one gets an NCCL communicator of one rank, which
// copies on the device where LocalCommunicator would memcpy on the host.
//
//   int dev = node_local_device();
//   CudaStream compute(dev), dp(dev, StreamPriority::High), pp(dev, StreamPriority::High);
//   NcclGroups nccl(*grid, dev, {.compute = compute.get(), .dp = dp.get(), .pp = pp.get()}, opts);
//   nccl.tp().all_reduce_async(partial, ReduceOp::Sum);
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "comm/nccl_communicator.h"
#include "comm/process_grid.h"

namespace xirang {

struct NcclStreams {
  cudaStream_t compute = nullptr;  // the layers' kernels; also the tp channel's stream
  cudaStream_t dp = nullptr;       // data-parallel gradient traffic
  cudaStream_t pp = nullptr;       // pipeline transfers
};

class NcclGroups {
 public:
  // Collective over the world (see the file comment); `device` is this
  // rank's CUDA device.
  NcclGroups(ProcessGrid& grid, int device, const NcclStreams& streams, const CommOptions& opts);

  NcclCommunicator& tp() { return *tp_; }
  NcclCommunicator& dp_grads() { return *dp_grads_; }
  NcclCommunicator& embedding() { return *embedding_; }
  NcclCommunicator& pp() { return *pp_; }

 private:
  // In creation order, so they are released in reverse.
  std::unique_ptr<NcclCommunicator> tp_, dp_grads_, embedding_, pp_;
};

// This process's CUDA device: its index among the ranks of MPI_COMM_WORLD on
// the same node, modulo the visible devices (0 when MPI is not running).
// Collective over MPI_COMM_WORLD. Throws ErrorKind::Comm when no device is
// visible.
int node_local_device();

}  // namespace xirang
