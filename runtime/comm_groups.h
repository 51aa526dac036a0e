// runtime/comm_groups.h: the communication groups and the device context a
// rank trains with.
//
// On the CPU the groups are the process grid's own (MPI), and the pipeline's
// four transfer queues are its pp group (PipeChannels::shared), or, with
// comm.ordered_p2p, OrderedLinks that match by order as NCCL does. With
// device.backend=cuda this rank takes its node-local GPU: a CudaContext (the
// compute stream and cuBLASLt), and with more than one rank NCCL groups for
// tensor parallelism, gradient buckets (on a high-priority stream of their
// own), the tied embedding and the pipeline's order-matched channels. The
// grid keeps its host groups for scalar reductions either way. Context
// parallelism's group (cp: attention's key/value gathers) is the grid's on
// the CPU and an NCCL group on the compute stream on CUDA, as tp's; the
// gradient buckets span dp x cp (parameters are replicated over both).
// Expert parallelism's groups (ep: the MoE all-to-all-v; expert_dp: expert
// gradient buckets) are the grid's on the CPU and with ep = 1 (a group of
// one; expert_dp is then dp_grads), NCCL's on CUDA with ep > 1.
//
//   CommGroups comm(cfg, grid, model_dtype);   // refuses a backend that cannot run here
//   TensorParallel tp{&comm.tp(), cfg.parallel.sequence_parallel};
//   PipelineExecutor exec(chunks, comm.pipe(), p, rank, v, m);
//   chunk->forward(comm.kernel_context(), ...);
//
// Release order: destroy a CommGroups before the arenas of its device. The
// NCCL channels must drain or abort before the arenas' cudaFree, which waits
// for the whole device and would hang behind a channel still waiting on a
// dead peer; an owner therefore declares it after its arenas.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/process_grid.h"
#include "kernels/context.h"
#include "runtime/config/config.h"
#include "runtime/step/pipeline.h"

namespace xirang {

// The MPI channels' options for a run of `cfg`: comm.timeout_s, comm.busy_poll
// (this rank's OpenMP team as its compute threads) and `trace_dir`.
CommOptions comm_options(const Config& cfg, std::string trace_dir = {});

class CommGroups {
 public:
  // `grid` must outlive the groups. Throws a Config error when
  // device.backend=cuda cannot run here (no CUDA build, no visible GPU, no
  // NCCL for several ranks, an f64 model) or asks for comm.ordered_p2p.
  CommGroups(const Config& cfg, ProcessGrid& grid, DType model_dtype);
  ~CommGroups();
  CommGroups(const CommGroups&) = delete;
  CommGroups& operator=(const CommGroups&) = delete;

  // Where the arenas live and the kernels run.
  Device device() const { return device_; }
  const KernelContext& kernel_context() const { return ctx_; }
  // The groups that move device tensors: the grid's own on the CPU, NCCL's on CUDA.
  Communicator& tp() const { return *tp_; }
  Communicator& cp() const { return *cp_; }
  // Gradient buckets and ZeRO-1's shards: the dp x cp ranks of this (tp, pp) position.
  Communicator& dp_grads() const { return *dp_grads_; }
  Communicator& embedding() const { return *embedding_; }
  // The ranks sharing the experts out, and the copies of this rank's experts.
  Communicator& ep() const { return *ep_; }
  Communicator& expert_dp() const { return *expert_dp_; }
  // The pipeline's transfer queues (runtime/step/pipeline.h).
  const PipeChannels& pipe() const { return pipe_; }
  // This rank's GPU's PCI bus id ("0000:3B:00.0", cudaDeviceGetPCIBusId), by
  // which NVML finds the same device (runtime/observe/energy_meter.h); empty on the CPU.
  const std::string& pci_bus_id() const { return pci_bus_id_; }

 private:
  void use_ordered_links(const Config& cfg, ProcessGrid& grid);
  void use_device(const Config& cfg, ProcessGrid& grid, DType model_dtype);
  void use_nccl(const Config& cfg, ProcessGrid& grid, int device);

  struct DeviceState;  // the CUDA context and NCCL groups (comm_groups.cc)
  Device device_ = Device::CPU;
  KernelContext ctx_;
  Communicator* tp_ = nullptr;
  Communicator* cp_ = nullptr;
  Communicator* dp_grads_ = nullptr;
  Communicator* embedding_ = nullptr;
  Communicator* ep_ = nullptr;
  Communicator* expert_dp_ = nullptr;
  PipeChannels pipe_;
  std::string pci_bus_id_;
  std::vector<std::unique_ptr<Communicator>> ordered_links_;  // comm.ordered_p2p: over the grid's pp group
  // Last, so released first: the NCCL channels before the CUDA context.
  std::unique_ptr<DeviceState> dev_;
};

}  // namespace xirang
