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
// The trainer owns the arenas, the model and the step; the rest is
// delegated: communication groups and the device context to CommGroups
// (runtime/comm_groups.h), saving and resuming to Checkpointer
// (runtime/checkpoint/checkpointer.h), fault injection to FaultInjector
// (runtime/faults.h), device-ready input to PrefetchLoader.
//
//   Config cfg = load_config(path, overrides);
//   validate(cfg, world_size);
//   Trainer trainer(cfg, TrainerOptions{}, grid.get());   // grid: nullptr for one rank
//   TrainResult r = trainer.run();   // r.losses[i] is step i + 1's loss
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_grid.h"
#include "core/arena.h"
#include "models/model.h"
#include "runtime/checkpoint/checkpointer.h"
#include "runtime/comm_groups.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/data/loader.h"
#include "runtime/data/sampler.h"
#include "runtime/observe/energy_meter.h"
#include "runtime/faults.h"
#include "runtime/step/grad_sync.h"
#include "runtime/observe/metrics.h"
#include "runtime/step/optimizer.h"
#include "runtime/step/pipeline.h"
#include "runtime/preemption.h"
#include "runtime/resilience/guards.h"
#include "runtime/resilience/loss_scale.h"
#include "runtime/step/schedule.h"
#include "runtime/observe/step_observer.h"

namespace xirang {

struct TrainerOptions {
  // F64 runs the whole model in double (exactness tests); otherwise the
  // model's dtype comes from precision.dtype.
  DType dtype = DType::F32;
  bool print = true;              // memory plan, progress line, summary on stderr (world rank 0)
  std::optional<PeakFlops> peak;  // skips measuring/config lookup (tests, benchmarks)
  // Polled at every step boundary (runtime/preemption.h); null: the run is never stopped by a signal.
  const StopSource* stop = nullptr;
};

// A run that a signal stopped at a step boundary (runtime/preemption.h).
struct Preemption {
  int signal = 0;          // SIGTERM, SIGUSR1
  int rank = -1;           // the highest world rank that received it
  int step = 0;            // the last completed step
  std::string checkpoint;  // the committed checkpoint of `step`; empty without checkpoint.dir
};

struct TrainResult {
  std::vector<double> losses;      // per step, the global batch's mean loss
  std::vector<double> grad_norms;  // per step, before clipping
  std::vector<StepMetrics> steps;
  std::optional<double> final_val_loss;
  std::optional<Preemption> preempted;  // set when a signal stopped the run before its last step
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
  // After the observers the config asks for, so it sees (and may override)
  // what they did at each step's start: benchmarks steering the timeline.
  void add_observer(std::unique_ptr<StepObserver> o) { observers_.push_back(std::move(o)); }
  Timeline& timeline() { return timeline_; }

 private:
  // Arena sizes, measured by running the carving code against measuring arenas.
  struct ArenaSizes {
    size_t params = 0, grads = 0, opt_state = 0, shard = 0, acts = 0, io = 0;
  };
  // Construction, in order: the communication groups (with the CUDA context
  // and NCCL groups under device.backend=cuda); the schedule; the datasets;
  // this rank's model chunks and executor; every arena (measured, planned,
  // checked against memory.limit_gb, allocated) with the parameters
  // initialised; the checkpoint to resume; the loader (after the resume,
  // which sets the first step); the MFU peak.
  void build_schedule();
  void open_data();
  void build_chunks();
  void build_arenas();
  void collect_parameters();
  void build_optimizer(Arena& measure_shard, Arena& measure_state);
  void plan_memory(const ArenaSizes& sizes);
  std::string recompute_line() const;
  void allocate_arenas(const ArenaSizes& sizes);
  void init_parameters();
  SampleRows sample_rows() const;  // this cp rank's rows of each sample
  void build_loader();
  void choose_peak();
  // On CUDA, this rank's GPU's energy meter; a warning line and none when NVML gives no readings.
  void build_energy_meter();
  void build_observers();
  void build_guard();

  // The step, in the order run() calls them.
  void zero_gradients();
  // Runs the step's schedule (its losses collect in the head chunk's loss
  // sum), then the tied copies' reductions and the pipeline drain, each in
  // its part of the step clock.
  void accumulate_gradients(int step);
  void delay_if_slow(int step);  // faults.kind=slow_rank
  void drain_pipeline();
  // On a device: timed host waits for the transfers the compute stream
  // joined, before the step's untimed stream synchronization.
  void wait_step_transfers();
  double take_local_loss();
  // nan_grad fault: poisons this rank's gradient of the first parameter its norm covers.
  void inject_nan_grad(int step);
  void update_parameters(double lr, double grad_norm, double scale);
  double global_loss(double local_loss);
  double optimizer_step(StepMetrics& m, int step);
  void evaluate_after(StepMetrics& m, TrainResult& result);
  void save_checkpoint(StepMetrics& m);
  void take_rates(StepMetrics& m, double step_ms) const;
  bool eval_due(int step) const;
  // After a stop request: the checkpoint of the completed step, written and committed.
  Preemption save_for_stop(const StopRequest& stop, const StepMetrics& m);
  // The one line on world rank 0; every rank leaves it together.
  void report_stop(const Preemption& p) const;

  // Sums a tied parameter's gradient over the chunks that hold it (the
  // pipeline's embedding group: first and last stage).
  void reduce_tied(Parameter& p);
  // The same for an original whose copy is on this rank: original + copy into both (the order of
  // the embedding group's two-rank sum, so bitwise the same), once the original's gradient is final.
  void sum_tied_locally(Parameter& original, Parameter& copy);
  // The step's parts from the clock (on a device, the compute parts from the stream).
  void take_parts(StepMetrics& m) const;
  void print_run() const;
  int last_step() const;
  double tokens_per_step() const { return double(cfg_.train.global_batch) * cfg_.seq_len(); }
  // The tokens of this rank's replica (its dp rank's share, and of it its cp
  // rank's rows): every rank of it (each tp shard, each pipeline stage) works on all of them.
  double tokens_per_replica() const { return tokens_per_step() / (double(cfg_.parallel.dp) * cfg_.parallel.cp); }
  bool is_logger() const { return grid_->world_rank() == 0; }

  Config cfg_;
  TrainerOptions opts_;
  std::unique_ptr<ProcessGrid> own_grid_;
  ProcessGrid* grid_;
  std::unique_ptr<FaultInjector> faults_;
  StopRequest stop_request_;      // the preemption signal agreed in this step's vote (none: no rank got one)
  std::unique_ptr<StepGuard> guard_;  // the step's skip vote (runtime/resilience/guards.h)
  std::vector<std::unique_ptr<StepObserver>> observers_;  // called at the end of every step
  std::unique_ptr<EnergyMeter> energy_;  // null on the CPU backend and where NVML gives no readings
  // Spans (metrics.trace) and per-op times (metrics.op_profile); ctx_.timeline
  // points here when either is on.
  Timeline timeline_;
  Device device_ = Device::CPU;
  KernelContext ctx_;  // the communication groups' kernel context
  DType model_dtype_ = DType::F32;
  LossScale loss_scale_;
  MemoryPlan plan_;
  PeakFlops peak_;
  ScheduleKind schedule_kind_;
  std::vector<PipeInstr> schedule_;
  std::vector<std::unique_ptr<ModelChunk>> chunks_;
  std::vector<Parameter> params_;  // every chunk's parameters (views), in arena order
  std::vector<Parameter*> tied_;         // parameters another rank's pipeline chunk also holds (originals)
  std::vector<Parameter*> tied_copies_;  // copies on this rank of another rank's originals (tied_copy)
  // (original, copy) both on this rank (zb_v's V puts the embedding and the head on rank 0): summed
  // here, with no transfer (sum_tied_locally).
  std::vector<std::pair<Parameter*, Parameter*>> local_tied_;
  std::vector<WorkPtr> tied_work_;       // the step's reductions of tied gradients
  // The step's parts (core/step_clock.h); ctx_.clock points here.
  StepClock clock_;
  DeviceTimes device_times_;  // on a device, the step's compute from the stream
  std::unique_ptr<PipelineExecutor> exec_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<GradSync> sync_;
  Arena params_arena_, grads_, opt_state_, shard_, acts_, io_;
  // After the state it saves: its saver thread is joined before that goes.
  std::unique_ptr<Checkpointer> ckpt_;
  std::optional<TokenDataset> train_data_, val_data_;
  std::unique_ptr<PrefetchLoader> loader_;  // null on middle pipeline stages: they read no input
  int64_t start_step_ = 0;                  // completed steps at start (a resumed run's checkpoint step)
  std::unique_ptr<SequenceSampler> val_sampler_;
  // Declared last so that it is released first: its NCCL channels drain or
  // abort before the arenas' cudaFree (runtime/comm_groups.h).
  std::unique_ptr<CommGroups> comm_;
};

}  // namespace xirang
