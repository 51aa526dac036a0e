// runtime/checkpoint/checkpointer.h: one rank's part in saving and resuming checkpoints.
//
// Owns what a save needs beyond the training state itself: the host
// snapshot arena (asynchronous saves, and every save of device memory, write
// from a copy taken at the end of the step), the saver thread that writes
// this rank's file while training goes on, and the commit that world rank 0
// makes once every rank's file is complete (checkpoint_io.h for the format
// and its atomic steps). Resume loads checkpoint.resume (auto: the newest
// under checkpoint.dir) into the parameters, the optimizer state and the
// loss scale, whatever layout saved it. The optimizer reaches it only as
// named tensors (models/optimizer_state.h) and fault injection only as a
// plain struct (save_faults.h): this wing depends on neither the step
// machinery nor the optimizer class.
//
// What a rank writes: each element once. Data-parallel replicas leave the
// parameters (and without ZeRO the optimizer state) to dp rank 0, and the
// last stage's copy of the tied token table is left to the first stage's.
//
//   Checkpointer ckpt(cfg, grid, TrainingState{params, opt.checkpoint_state(), loss_scale}, device,
//                     faults.save_faults(), print);
//   if (ckpt.uses_snapshot()) ckpt.allocate_snapshot(bytes);
//   int64_t start = ckpt.resume(model_dtype);       // completed steps; 0 for a fresh run
//   for (int step = start; step < last; ++step) {
//     ckpt.poll();                                  // commits a finished asynchronous save
//     ...                                           // the step
//     if (ckpt.due(step + 1, last)) ckpt.save(step + 1, stream);
//   }
//   ckpt.finish();                                  // waits for and commits the last save
//
// A save that fails on any rank (disk full, permissions, I/O), or would hold
// a non-finite value, is dropped on every rank: its partial directory goes,
// `latest` and the committed checkpoints stay, and checkpoint.on_error says
// whether the run stops (one error line) or warns and trains on. An
// asynchronous save's failure surfaces at the poll() of a later step.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "comm/process_grid.h"
#include "core/arena.h"
#include "core/timeline.h"
#include "models/parameter.h"
#include "models/optimizer_state.h"
#include "runtime/checkpoint/save_faults.h"
#include "runtime/config/config.h"
#include "runtime/resilience/loss_scale.h"

namespace xirang {

class CheckpointReader;

// The training state a checkpoint holds besides the step; the trainer owns it.
struct TrainingState {
  std::vector<Parameter>& params;  // every chunk's parameters (views), in arena order
  OptimizerState& optimizer;       // its named tensors index `params`; read at each save, written by resume
  LossScale& loss_scale;
};

class Checkpointer {
 public:
  // Everything referenced must outlive the checkpointer. `print`: resume
  // messages on stderr (the caller passes it for world rank 0 only).
  Checkpointer(const Config& cfg, ProcessGrid& grid, TrainingState state, Device device, SaveFaults faults,
               bool print);
  // Joins a saver thread still running; only finish() commits its save.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Whether saves go through a host snapshot (checkpoint.async, or the
  // tensors live on a device); allocate_snapshot then takes the bytes of
  // the parameter and optimizer state arenas.
  bool uses_snapshot() const;
  void allocate_snapshot(size_t bytes);

  // Loads the checkpoint that checkpoint.resume names, if any; returns the
  // completed steps it holds (0 when the run starts fresh).
  int64_t resume(DType model_dtype);

  // Whether the step that has just completed saves: every checkpoint.every
  // steps and at `last`, when checkpoint.dir is set.
  bool due(int steps_done, int last) const;
  // Writes the checkpoint of `steps_done` completed steps (every rank takes
  // part). With a snapshot the tensors are copied to it (on `stream`, the
  // compute stream) and a background thread writes the file; the step
  // stalls only for the copy. `tl`: where the snapshot and the write go on
  // the timeline (the write on its Checkpoint track when asynchronous).
  void save(int64_t steps_done, void* stream, Timeline* tl = nullptr);
  // Commits the save in flight when every rank's file is written (one small
  // all-reduce; call it at the same point on every rank).
  void poll();
  // Waits for the save in flight and commits it.
  void finish();

 private:
  struct SaveEntry {
    std::string group, name;
    ShardSpec shard;
    int64_t begin = 0, end = 0;  // the range of the shard's flat view that `data` holds
    Tensor data;
  };
  // What the saver thread writes: the tensors and the scalars of one step.
  struct SaveJob {
    std::string tmp_dir;
    int64_t steps_done = 0;
    std::vector<SaveEntry> entries;
    bool kill = false;      // fault injection: die halfway through the file
    bool io_error = false;  // fault injection: the write fails halfway through the file (EIO)
    double loss_scale = 0;  // the dynamic loss scale's state; 0: none to continue
    int good_steps = 0, hysteresis_left = 0;
    int64_t updates = 0;
    Timeline* tl = nullptr;
    Track track = Track::Main;  // where the write's span goes
  };
  std::vector<SaveEntry> entries_to_save() const;
  void snapshot(std::vector<SaveEntry>& entries, void* stream);
  void write(const SaveJob& job);
  void commit();
  std::string nonfinite_entry(const std::vector<SaveEntry>& entries, void* stream) const;
  // Agrees on whether the save in flight failed (`why_here`: this rank's
  // error, "" if none); true when no rank failed. Otherwise drops the save
  // (removing its tmp directory when `remove_tmp`) and, under
  // checkpoint.on_error=stop, throws the lowest failing rank's error.
  bool settle(const std::string& why_here, bool remove_tmp);

  std::optional<std::string> resume_path() const;
  void check_model(const CheckpointReader& r, const std::string& path) const;
  void read_optimizer(const CheckpointReader& r, const std::string& path);
  void restore_loss_scale(const CheckpointReader& r);
  // Reads checkpoint tensor elements into `dst`, through host memory when it lives on a device.
  void read(const CheckpointReader& r, std::string_view group, const Parameter& p, int64_t begin, int64_t end,
            Tensor dst) const;
  bool is_logger() const { return grid_.world_rank() == 0; }

  const Config& cfg_;
  ProcessGrid& grid_;
  TrainingState state_;
  Device device_;
  SaveFaults faults_;
  bool print_;
  Arena snapshot_;  // host copy of what this rank saves
  std::thread saver_;
  std::atomic<bool> save_done_{false};
  std::exception_ptr save_error_;
  int64_t pending_step_ = -1;  // the step of the save in flight, -1 when none
};

}  // namespace xirang
