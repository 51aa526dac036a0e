// runtime/observe/metrics.h: per-step metrics, the JSON-lines log and the live
// progress line.
//
//   MetricsLog log(cfg.metrics.jsonl, peak, {.straggler = true});  // empty path: no file
//   log.write(m);                                 // one JSON object per step
//   ProgressLine progress(total_steps, every);    // '\r' line on a terminal
//   progress.update(m);
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "kernels/context.h"
#include "core/timeline.h"

namespace xirang {

// The FLOP/s that MFU is measured against, and where the number came from.
struct PeakFlops {
  double flops = 0;    // per rank
  std::string source;  // "config metrics.peak_tflops" or "measured sgemm"
};

// A step's energy on this rank's device (runtime/observe/energy_meter.h).
struct StepEnergy {
  double joules = 0;            // the whole device's energy over the step
  double joules_per_token = 0;  // joules over the tokens this rank processed in the step
  double avg_watts = 0;         // joules over the step's wall time
};

struct StepMetrics {
  int step = 0;  // 1-based
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  // The step's wall time and its disjoint parts (docs/metrics.md): on the
  // CPU forward + backward + optimizer + data_wait + dp_comm_exposed +
  // tp_comm + pp_bubble + pp_comm_exposed + ckpt_stall + (small, unnamed
  // host work) = step_ms, each interval counted once. Evaluation runs after
  // step_ms is taken. On a device forward and backward are device times.
  double step_ms = 0;
  double mfu = 0;  // fraction of the peak
  double forward_ms = 0;          // forward passes, less the tensor-parallel communication inside them
  double backward_ms = 0;         // backward passes, less that and the gradient-ready hook's communication
  double optimizer_ms = 0;        // gradient norm, loss-scale vote, update; less its dp waits
  double data_wait_ms = 0;        // getting input: blocked on the loader plus copying each microbatch in
  int data_prefetch_depth = 0;    // microbatches the loader keeps in flight (adaptive)
  double dp_comm_ms = 0;          // time data-parallel communication took this step (overlapped or not)
  double dp_comm_exposed_ms = 0;  // time the step spent on it: bucket launches and waits
  double tp_comm_ms = 0;          // time in tensor-parallel collectives (blocking, so all exposed)
  double cp_comm_ms = 0;          // time in context-parallel key/value collectives (blocking, so all exposed)
  double pp_bubble_ms = 0;        // time this stage waited for a neighbour's activation or gradient, or the drain
  double pp_comm_exposed_ms = 0;  // time it waited for its own pipeline sends and the tied-embedding reduction
  double ckpt_stall_ms = 0;       // time the step was stopped to save a checkpoint
  // What no part claimed (the step's own bookkeeping between the parts): on
  // the CPU the parts and this add up to step_ms (core/step_clock.h).
  double unaccounted_ms = 0;
  // Time the step's main thread was ready to run but waited for a core
  // (other processes, or more threads than cores); not one of the parts
  // above: it is inside whichever part was running. Unset where the kernel
  // does not report it.
  std::optional<double> cpu_wait_ms;
  bool checkpoint_saved = false;  // the step saved a checkpoint
  double loss_scale = 1;          // the fp16 loss scale the step ran with (1: none)
  bool skipped = false;           // gradients overflowed: no update this step
  std::optional<double> val_loss;
  // Set by the step observers (runtime/observe/step_observer.h) on the steps they check:
  int slowest_rank = -1;          // world rank with the longest compute time at the last straggler check (-1: none yet)
  double straggler_ratio = 0;     // its compute time over the median rank's (0: not checked yet)
  double straggler_extra_ms = 0;  // its compute time less the median rank's (0: not checked yet)
  bool below_baseline = false;    // tokens/s has stayed below metrics.baseline's tolerance band
  // metrics.op_profile: time and calls per kind of op this step (core/timeline.h OpKind).
  std::optional<OpTimes> ops;
  // The device's energy over the step: CUDA runs whose NVML gives readings; unset on the CPU backend.
  std::optional<StepEnergy> energy;
};

// The fields of metrics.jsonl that only some runs have: those of the step
// observers that are on.
struct JsonlFields {
  bool straggler = false;  // slowest_rank, straggler_ratio, straggler_extra_ms (metrics.straggler_every > 0)
  bool baseline = false;   // below_baseline (metrics.baseline set)
  bool ops = false;        // op_ms, op_calls (metrics.op_profile)
};

// Measures this process's fp32 matrix rate (sgemm of n x n) for about `seconds`.
double measure_sgemm_flops(int n = 1024, double seconds = 0.3);
// Measures ctx's device's dense matrix-product rate in `dtype` (n x n x n
// products of random values through the matmul op training uses, `reps`
// of them after two warm-up ones, the mean): the limit a GPU's MFU is read
// against, since a datasheet's peak is not reached in practice.
double measure_device_gemm_flops(const KernelContext& ctx, DType dtype, int n = 8192, int reps = 10);

class MetricsLog {
 public:
  MetricsLog(const std::string& path, PeakFlops peak, JsonlFields fields = {});  // creates parent directories
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const StepMetrics& m);
  const std::string& path() const { return path_; }
  // The writer's memory plan total (bytes), written on every line as memory_planned_bytes.
  void set_planned_bytes(size_t bytes) { planned_bytes_ = bytes; }
  // Written on every line: the device backend ("cpu", "cuda"), and where a
  // step's energy came from (energy_source, on lines that have energy).
  void set_backend(std::string backend) { backend_ = std::move(backend); }
  void set_energy_source(std::string source) { energy_source_ = std::move(source); }

 private:
  std::string path_;
  PeakFlops peak_;
  JsonlFields fields_;
  size_t planned_bytes_ = 0;
  std::string backend_ = "cpu";
  std::string energy_source_;
  std::FILE* f_ = nullptr;
};

class ProgressLine {
 public:
  ProgressLine(int total_steps, int every);
  void update(const StepMetrics& m, double elapsed_s);
  void finish();  // ends a terminal line

 private:
  int total_;
  int every_;
  bool tty_;
  bool open_ = false;
};

}  // namespace xirang
