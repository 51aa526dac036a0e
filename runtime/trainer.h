// runtime/trainer.h: the training loop of one rank.
//
// Builds the model, optimizer and data from a validated Config, prints the
// memory plan (refusing to start when it exceeds memory.limit_gb), then runs
// train.steps optimizer steps: gradient accumulation over microbatches,
// global-norm clipping, AdamW with warmup and cosine decay, validation every
// train.eval_every steps, metrics per step.
//
//   Config cfg = load_config(path, overrides);
//   validate(cfg, 1);
//   Trainer trainer(cfg, TrainerOptions{.dtype = DType::F32});
//   TrainResult r = trainer.run();   // r.losses[i] is step i + 1's loss
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "models/gpt2.h"
#include "runtime/config.h"
#include "runtime/dataset.h"
#include "runtime/metrics.h"
#include "runtime/optimizer.h"
#include "runtime/sampler.h"

namespace xirang {

struct TrainerOptions {
  DType dtype = DType::F32;   // model and optimizer dtype (F64 for exactness tests)
  bool print = true;          // memory plan, progress line, summary on stderr
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
  Trainer(const Config& cfg, TrainerOptions opts = {});
  TrainResult run();
  // Mean loss over train.eval_batches microbatches of the validation split.
  double evaluate();
  GPT2& model() { return *model_; }
  const MemoryPlan& memory_plan() const { return plan_; }
  const PeakFlops& peak() const { return peak_; }

 private:
  // Runs forward and backward over this step's microbatches; returns the mean loss.
  double accumulate_gradients(int step, StepMetrics& m);

  Config cfg_;
  TrainerOptions opts_;
  KernelContext ctx_;
  MemoryPlan plan_;
  PeakFlops peak_;
  std::unique_ptr<GPT2> model_;
  std::unique_ptr<AdamW> opt_;
  Arena params_, grads_, opt_state_, acts_, io_;
  Tensor tokens_, targets_;  // (B, T) int32 for the current microbatch
  std::optional<TokenDataset> train_data_, val_data_;
  std::unique_ptr<SequenceSampler> train_sampler_, val_sampler_;
};

}  // namespace xirang
