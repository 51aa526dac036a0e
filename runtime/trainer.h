// runtime/trainer.h: the training loop of one rank.
//
// Builds this rank's model chunks (its pipeline stage, or its virtual
// stages under the interleaved schedule), the pipeline executor, gradient
// synchronisation, optimizer and data from a validated Config and a
// ProcessGrid; prints the memory plan (refusing to start when it exceeds
// memory.limit_gb); then runs train.steps optimizer steps: the pipeline
// schedule's forwards and backwards over the step's microbatches, bucketed
// data-parallel gradient reduction overlapped with the last backward,
// the tied-embedding reduction between first and last stage, global-norm
// clipping, AdamW (ZeRO-1 sharded when parallel.zero=1) with warmup and
// cosine decay, validation every train.eval_every steps, metrics per step.
// Every rank computes the same global loss; world rank 0 prints and logs.
//
//   Config cfg = load_config(path, overrides);
//   validate(cfg, world_size);
//   Trainer trainer(cfg, TrainerOptions{}, grid.get());   // grid: nullptr for one rank
//   TrainResult r = trainer.run();   // r.losses[i] is step i + 1's loss
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <optional>
#include <thread>
#include <string>
#include <string_view>
#include <vector>

#include "comm/process_grid.h"
#include "core/arena.h"
#include "models/model.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/grad_sync.h"
#include "runtime/data/loader.h"
#include "runtime/metrics.h"
#include "runtime/optimizer.h"
#include "runtime/pipeline.h"
#include "runtime/data/sampler.h"
#include "runtime/schedule.h"

namespace xirang {

struct TrainerOptions {
  // F64 runs the whole model in double (exactness tests); otherwise the
  // model's dtype comes from precision.dtype.
  DType dtype = DType::F32;
  bool print = true;              // memory plan, progress line, summary on stderr (world rank 0)
  std::optional<PeakFlops> peak;  // skips measuring/config lookup (tests, benchmarks)
};

struct TrainResult {
  std::vector<double> losses;      // per step, the global batch's mean loss
  std::vector<double> grad_norms;  // per step, before clipping
  std::vector<StepMetrics> steps;
  std::optional<double> final_val_loss;
};

class Trainer {
 public:
  // `grid` may be null (one rank); it must outlive the trainer.
  Trainer(const Config& cfg, TrainerOptions opts = {}, ProcessGrid* grid = nullptr);
  ~Trainer();
  TrainResult run();
  // Mean loss over train.eval_batches microbatches of the validation split
  // (split over dp ranks, the same number on every rank).
  double evaluate();
  // This rank's model chunks (one per virtual stage) and all their parameters, in arena order.
  const std::vector<std::unique_ptr<ModelChunk>>& chunks() const { return chunks_; }
  ModelChunk& model() { return *chunks_.front(); }
  std::vector<Parameter>& parameters() { return params_; }
  const MemoryPlan& memory_plan() const { return plan_; }
  const PeakFlops& peak() const { return peak_; }
  ProcessGrid& grid() { return *grid_; }
  int64_t start_step() const { return start_step_; }
  // Parameters and activations (precision.dtype, or F64 from the options).
  DType model_dtype() const { return model_dtype_; }
  const LossScale& loss_scale() const { return loss_scale_; }
  const AdamW& optimizer() const { return *opt_; }

 private:
  // Construction, in order: the CUDA context and NCCL groups (device.backend=cuda);
  // this rank's model chunks; every arena (measured, planned, checked
  // against memory.limit_gb, allocated) with the parameters initialised;
  // the loader (after resume(), which sets the first step); the MFU peak.
  void init_device();
  void build_chunks();
  void build_arenas();
  void build_loader();
  void choose_peak();
  // Runs the step's schedule (its losses collect in the head chunk's loss
  // sum) and fills the step's pipeline timings.
  void accumulate_gradients(int step, StepMetrics& m);
  // Sums a tied parameter's gradient over the chunks that hold it (the
  // pipeline's embedding group: first and last stage).
  void reduce_tied(Parameter& p);
  void inject_fault(int step);
  // Writes the checkpoint of `steps_done` completed steps (every rank takes
  // part). Asynchronous: the tensors are copied to the snapshot arena and a
  // background thread writes them while training goes on.
  void save_checkpoint(int64_t steps_done);
  // An asynchronous save is committed once every rank's file is written:
  // poll_save() checks (one small all-reduce) and commits when all are done;
  // finish_save() waits for it.
  void poll_save();
  void finish_save();
  void commit_save();
  // Loads checkpoint.resume (auto: the newest under checkpoint.dir) into the
  // parameters and optimizer state, whatever layout saved it; sets start_step_.
  void resume();
  bool is_logger() const { return grid_->world_rank() == 0; }

  // Reads checkpoint tensor elements into `dst`, through host memory when it lives on a device.
  void read_checkpoint(const class CheckpointReader& r, std::string_view group, const Parameter& p, int64_t begin,
                       int64_t end, Tensor dst);

  Config cfg_;
  TrainerOptions opts_;
  struct DeviceState;  // defined in trainer.cc; dev_ is the last member
  Device device_ = Device::CPU;
  // The groups that move device tensors: the grid's own on the CPU, NCCL's on CUDA.
  Communicator* tp_comm_ = nullptr;
  Communicator* dp_grads_comm_ = nullptr;
  Communicator* embedding_comm_ = nullptr;
  // The pipeline's transfer queues (runtime/pipeline.h): the grid's pp
  // group for all four on the CPU, order-matched NCCL channels on CUDA,
  // OrderedLinks (owned by ordered_links_) with comm.ordered_p2p.
  PipeChannels pipe_;
  std::unique_ptr<ProcessGrid> own_grid_;
  ProcessGrid* grid_;
  std::vector<std::unique_ptr<Communicator>> ordered_links_;  // after the grid: released before it
  KernelContext ctx_;
  DType model_dtype_ = DType::F32;
  LossScale loss_scale_;
  MemoryPlan plan_;
  PeakFlops peak_;
  ScheduleKind schedule_kind_;
  std::vector<PipeInstr> schedule_;
  std::vector<std::unique_ptr<ModelChunk>> chunks_;
  std::vector<Parameter> params_;  // every chunk's parameters (views), in arena order
  std::vector<Parameter*> tied_;         // parameters another pipeline chunk also holds (originals)
  std::vector<Parameter*> tied_copies_;  // their copies on this rank (tied_copy)
  std::vector<WorkPtr> tied_work_;       // the step's reductions of tied gradients
  std::unique_ptr<PipelineExecutor> exec_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<GradSync> sync_;
  Arena params_arena_, grads_, opt_state_, shard_, acts_, io_;
  Arena snapshot_;  // host copy of what this rank saves (asynchronous checkpoints)
  struct SaveEntry {
    std::string group, name;
    ShardSpec shard;
    int64_t begin = 0, end = 0;
    Tensor data;
  };
  std::thread saver_;
  std::atomic<bool> save_done_{false};
  std::exception_ptr save_error_;
  int64_t pending_step_ = -1;  // the step of the save in flight, -1 when none
  std::optional<TokenDataset> train_data_, val_data_;
  std::unique_ptr<PrefetchLoader> loader_;  // null on middle pipeline stages: they read no input
  int64_t start_step_ = 0;                  // completed steps at start (a resumed run's checkpoint step)
  std::unique_ptr<SequenceSampler> val_sampler_;
  // The CUDA stream, cuBLASLt handle and NCCL channels of device.backend=cuda
  // (null on the CPU). Declared last so that it is released first: the NCCL
  // channels drain or abort before the arenas' cudaFree, which waits for the
  // whole device and would hang behind a channel still waiting on a dead peer.
  std::unique_ptr<DeviceState> dev_;
};

}  // namespace xirang
