#include "runtime/comm_groups.h"

#include <omp.h>

#include <string>

#include "comm/ordered_link.h"
#include "core/device_memory.h"
#include "core/error.h"
#ifdef XIRANG_HAVE_CUDA
#include "core/cuda_check.h"
#include "core/cuda_stream.h"
#include "kernels/cuda/context.h"
#endif
#ifdef XIRANG_HAVE_NCCL
#include "comm/nccl_groups.h"
#endif

namespace xirang {

CommOptions comm_options(const Config& cfg, std::string trace_dir) {
  const BusyPollMode b = cfg.comm.busy_poll;
  return CommOptions{.timeout_s = cfg.comm.timeout_s,
                     .trace_dir = std::move(trace_dir),
                     .busy_poll = b == BusyPollMode::On ? BusyPoll::On : b == BusyPollMode::Off ? BusyPoll::Off : BusyPoll::Auto,
                     .compute_threads = omp_get_max_threads()};
}

namespace {

// device.backend=cuda is refused with the reason when it cannot run here.
void check_backend(const Config& c) {
  if (c.comm.nccl_alone && c.device.backend != Backend::CUDA)
    fail(ErrorKind::Config, "comm.nccl_alone=true builds NCCL groups on a GPU; this run has device.backend=cpu");
  if (c.device.backend != Backend::CUDA) return;
#ifndef XIRANG_HAVE_CUDA
  fail(ErrorKind::Config, "device.backend=cuda: this build has no CUDA backend (configure with -DXIRANG_CUDA=ON "
                          "on a machine with the CUDA toolkit)");
#else
  if (!cuda_available())
    fail(ErrorKind::Config, "device.backend=cuda: no CUDA device is visible (cudaGetDeviceCount found none; "
                            "check CUDA_VISIBLE_DEVICES and the driver), use device.backend=cpu");
#ifndef XIRANG_HAVE_NCCL
  if (c.parallel.dp * c.parallel.cp * c.parallel.tp * c.parallel.pp > 1)
    fail(ErrorKind::Config, "device.backend=cuda with dp ", c.parallel.dp, " x cp ", c.parallel.cp, " x tp ",
         c.parallel.tp, " x pp ", c.parallel.pp, " needs NCCL, which this build did not find (set NCCL_ROOT and reconfigure)");
#endif
  if (c.comm.ordered_p2p)
    fail(ErrorKind::Config, "comm.ordered_p2p emulates NCCL's matching over MPI for the CPU backend; "
                            "device.backend=cuda uses NCCL itself");
#ifndef XIRANG_HAVE_NCCL
  if (c.comm.nccl_alone)
    fail(ErrorKind::Config, "comm.nccl_alone=true needs NCCL, which this build did not find (set NCCL_ROOT and reconfigure)");
#endif
#endif
}

#ifdef XIRANG_HAVE_CUDA
// The GPU of this rank among its node's ranks (several ranks need NCCL).
int local_device() {
#ifdef XIRANG_HAVE_NCCL
  return node_local_device();
#else
  return 0;
#endif
}
#endif

}  // namespace

struct CommGroups::DeviceState {
#ifdef XIRANG_HAVE_CUDA
  std::unique_ptr<CudaContext> cuda;
#endif
#ifdef XIRANG_HAVE_NCCL
  std::unique_ptr<CudaStream> dp_stream;
  std::unique_ptr<NcclGroups> nccl;
#endif
};

CommGroups::CommGroups(const Config& cfg, ProcessGrid& grid, DType model_dtype) {
  check_backend(cfg);
  tp_ = &grid.tp();
  cp_ = &grid.cp();
  dp_grads_ = &grid.dp_grads();
  embedding_ = &grid.embedding();
  ep_ = &grid.ep();
  expert_dp_ = &grid.expert_dp();
  pipe_ = PipeChannels::shared(grid.pp());
  if (cfg.comm.ordered_p2p && grid.shape().pp > 1) use_ordered_links(cfg, grid);
  dev_ = std::make_unique<DeviceState>();
  if (cfg.device.backend == Backend::CUDA) use_device(cfg, grid, model_dtype);
}

CommGroups::~CommGroups() = default;

void CommGroups::use_ordered_links(const Config& cfg, ProcessGrid& grid) {
  // One link per edge colour and direction over the pp group; their tags
  // lie above the executor's and the evaluation's, below MPI's guaranteed 32767.
  const int p = grid.shape().pp;
  std::vector<Communicator*> act, grad;
  for (int i = 0; i < 2 * pipe_colors(p); ++i) {
    const bool is_act = i < pipe_colors(p);
    const std::string name = str_cat(is_act ? "pp_act" : "pp_grads", i % pipe_colors(p));
    ordered_links_.push_back(std::make_unique<OrderedLink>(grid.pp(), name, 32000 + 3 * i, cfg.comm.timeout_s));
    (is_act ? act : grad).push_back(ordered_links_.back().get());
  }
  pipe_ = colored_pipe_channels(grid.coords().pp, p, act, grad);
}

void CommGroups::use_device(const Config& cfg, ProcessGrid& grid, DType model_dtype) {
  if (model_dtype == DType::F64) fail(ErrorKind::Config, "device.backend=cuda does not run f64 models");
#ifdef XIRANG_HAVE_CUDA
  device_ = Device::CUDA;
  const bool alone = grid.shape().world() == 1;
  const int dev = alone ? 0 : local_device();
  dev_->cuda = std::make_unique<CudaContext>(dev);
  ctx_ = dev_->cuda->kernel_context();
  char bus_id[32] = "";
  XR_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, dev));
  pci_bus_id_ = bus_id;
  if (!alone || cfg.comm.nccl_alone) use_nccl(cfg, grid, dev);
#else
  (void)cfg, (void)grid;  // check_backend() has refused device.backend=cuda
#endif
}

void CommGroups::use_nccl(const Config& cfg, ProcessGrid& grid, int device) {
#ifdef XIRANG_HAVE_NCCL
  const int p = grid.shape().pp;
  // Gradient buckets on their own high-priority stream; tp on the compute stream.
  dev_->dp_stream = std::make_unique<CudaStream>(device, StreamPriority::High);
  dev_->nccl = std::make_unique<NcclGroups>(grid, device, NcclStreams{dev_->cuda->stream(), dev_->dp_stream->get()},
                                            p > 1 ? pipe_colors(p) : 0, CommOptions{.timeout_s = cfg.comm.timeout_s, .trace = grid.trace()});
  tp_ = &dev_->nccl->tp();
  cp_ = &dev_->nccl->cp();
  dp_grads_ = &dev_->nccl->dp_grads();
  embedding_ = &dev_->nccl->embedding();
  // ep = 1: the grid's group of one (LocalCommunicator copies device tensors
  // too) and expert_dp is dp_grads, as on the grid.
  if (dev_->nccl->has_ep()) {
    ep_ = &dev_->nccl->ep();
    expert_dp_ = &dev_->nccl->expert_dp();
  } else {
    expert_dp_ = dp_grads_;
  }
  if (p > 1) pipe_ = colored_pipe_channels(grid.coords().pp, p, dev_->nccl->pp_act(), dev_->nccl->pp_grads());
#else
  (void)cfg, (void)grid, (void)device;  // check_backend() has refused several ranks without NCCL
#endif
}

}  // namespace xirang
