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
//   cp         compute   compute (itself)      attention's keys and values (gathers)
//   dp_grads   dp        compute               gradient buckets, ZeRO gathers
//   embedding  dp        compute               the tied token table's gradient
//   ep         compute   compute (itself)      MoE tokens out and back (all-to-all-v); ep > 1 only
//   expert_dp  dp        compute               expert gradient buckets; ep > 1 only
//   pp_act[c]  own (c)   compute               activations, edge colour c
//   pp_grads[c] own (c)  compute               input gradients, edge colour c
//
// The pipeline channels are order-matched queues, one per edge colour and
// direction (runtime/step/pipeline.h, pipe_edge_color), each on a high-priority
// stream the groups own, so that a rank's four pipeline queues never wait on
// one another.
//
// Every rank must create it at the same point, since each channel's set-up
// is collective over its group (and bootstraps over the grid's channel of the
// same group). A group of one gets an NCCL communicator of one rank, which
// copies on the device where LocalCommunicator would memcpy on the host.
//
//   int dev = node_local_device();
//   CudaStream compute(dev), dp(dev, StreamPriority::High);
//   NcclGroups nccl(*grid, dev, {.compute = compute.get(), .dp = dp.get()}, pipe_colors(pp), opts);
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
};

class NcclGroups {
 public:
  // Collective over the world (see the file comment); `device` is this
  // rank's CUDA device, `pp_colors` the pipeline channels per direction
  // (pipe_colors(pp); none when pp = 1).
  NcclGroups(ProcessGrid& grid, int device, const NcclStreams& streams, int pp_colors, const CommOptions& opts);
  // When any channel has failed, aborts them all before they are released:
  // draining one could otherwise wait its whole timeout on a dead peer.
  ~NcclGroups();
  NcclGroups(const NcclGroups&) = delete;
  NcclGroups& operator=(const NcclGroups&) = delete;

  NcclCommunicator& tp() { return *tp_; }
  NcclCommunicator& cp() { return *cp_; }
  NcclCommunicator& dp_grads() { return *dp_grads_; }
  NcclCommunicator& embedding() { return *embedding_; }
  // Expert parallelism's channels, made only when the grid's ep > 1 (with
  // ep = 1 the grid's ep group is one rank and its expert_dp is dp_grads).
  bool has_ep() const { return ep_ != nullptr; }
  NcclCommunicator& ep() { return *ep_; }
  NcclCommunicator& expert_dp() { return *expert_dp_; }
  // The pipeline channels of each edge colour (`colors` of each, see the constructor).
  std::vector<Communicator*> pp_act() const;
  std::vector<Communicator*> pp_grads() const;

 private:
  // In creation order, so they are released in reverse.
  std::vector<CudaStream> pp_streams_;  // declared first: released after the channels that use them
  std::unique_ptr<NcclCommunicator> tp_, cp_, dp_grads_, embedding_, ep_, expert_dp_;
  std::vector<std::unique_ptr<NcclCommunicator>> pp_act_, pp_grads_;
};

// This process's CUDA device: its index among the ranks of MPI_COMM_WORLD on
// the same node, modulo the visible devices (0 when MPI is not running).
// Collective over MPI_COMM_WORLD. Throws ErrorKind::Comm when no device is
// visible.
int node_local_device();

}  // namespace xirang
