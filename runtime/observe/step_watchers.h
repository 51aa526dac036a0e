// runtime/observe/step_watchers.h: the step observers that write what a run shows
// as it goes (runtime/observe/step_observer.h): metrics.jsonl, the progress line on
// stderr, and the trace window (metrics.trace).
//
//   observers.push_back(std::make_unique<JsonlObserver>(cfg.metrics.jsonl, peak, fields, plan.total(), "cpu", ""));
//   observers.push_back(std::make_unique<ProgressObserver>(cfg.train.steps, cfg.metrics.log_every));
//   observers.push_back(std::make_unique<TraceObserver>(cfg.metrics, grid, timeline));
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "core/clock.h"
#include "core/timeline.h"
#include "runtime/observe/metrics.h"
#include "runtime/observe/step_observer.h"
#include "runtime/observe/trace_writer.h"

namespace xirang {

// metrics.jsonl (MetricsLog), opened when the first step begins: a trainer
// built and never run (an evaluation) leaves the file alone.
class JsonlObserver final : public StepObserver {
 public:
  JsonlObserver(std::string path, PeakFlops peak, JsonlFields fields, size_t planned_bytes, std::string backend,
                std::string energy_source);
  void on_step_begin(int step) override;
  void on_step(StepMetrics& m) override { log_->write(m); }

 private:
  std::string path_, backend_, energy_source_;
  PeakFlops peak_;
  JsonlFields fields_;
  size_t planned_bytes_;
  std::unique_ptr<MetricsLog> log_;
};

// The progress line (ProgressLine); its ETA counts from the first step.
class ProgressObserver final : public StepObserver {
 public:
  ProgressObserver(int total_steps, int every) : line_(total_steps, every) {}
  void on_step_begin(int) override {
    if (!elapsed_) elapsed_.emplace();
  }
  void on_step(StepMetrics& m) override { line_.update(m, elapsed_->seconds()); }
  void on_finish() override { line_.finish(); }

 private:
  ProgressLine line_;
  std::optional<Stopwatch> elapsed_;
};

// The trace window (TraceWindow) over the trainer's timeline. Its finish
// runs after the checkpoint writer's (the trainer finishes that first), so
// a write still in flight at the window's end is in it.
class TraceObserver final : public StepObserver {
 public:
  TraceObserver(const MetricsConfig& m, ProcessGrid& grid, Timeline& tl) : window_(m, grid), tl_(tl) {}
  void on_step_begin(int step) override { window_.before_step(step, tl_); }
  void on_step(StepMetrics& m) override { window_.after_step(m.step, tl_); }
  void on_finish() override { window_.finish(tl_); }

 private:
  TraceWindow window_;
  Timeline& tl_;
};

}  // namespace xirang
