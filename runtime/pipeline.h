// runtime/pipeline.h: runs one rank's pipeline instruction list.
//
// The executor owns this rank's model chunks (one GPT2 per virtual stage)
// and the pipeline channel. Receives are posted ahead of the instruction
// that needs them (activations straight into the activation slot the
// forward will use), sends never block compute (an activation is sent from
// its slot, which stays untouched until that microbatch's backward; an
// input gradient from a small pool of send buffers), and time spent waiting
// is measured: waiting for a neighbour's activation or gradient is pipeline
// bubble, waiting for one of our own sends to finish is exposed pipeline
// communication. The pipeline channel is its own communicator with its own
// thread, so its transfers never queue behind data-parallel buckets.
//
//   PipelineExecutor exec(chunks, grid.pp(), p, rank, v, m);
//   exec.layout(arena);                         // measuring, then real
//   exec.run(ctx, list, feed, dloss, stats);
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "comm/communicator.h"
#include "core/device_memory.h"
#include "core/arena.h"
#include "models/gpt2.h"
#include "runtime/schedule.h"

namespace xirang {

struct PipelineStats {
  double forward_ms = 0;
  double backward_ms = 0;
  double data_ms = 0;
  double bubble_ms = 0;       // waiting for a neighbour's activation or gradient
  double comm_exposed_ms = 0; // waiting for our own sends to complete
};

class PipelineExecutor {
 public:
  // Fills the (B, T) tokens and targets of microbatch `mb`; either may be
  // null when this rank's chunks do not need it (only the first stage reads
  // tokens, only the last reads targets).
  using Feed = std::function<void(int mb, int32_t* tokens, int32_t* targets)>;

  // `chunks[c]` is local chunk c (model chunk c * p + rank); m microbatches per step.
  PipelineExecutor(std::vector<GPT2*> chunks, Communicator& pp, int p, int rank, int v, int m);
  // Carves the token/target buffers of every activation slot and the gradient buffers.
  void layout(Arena& a);
  // Runs `list` up to ReduceGradients. The microbatch losses collect in the
  // head chunk's loss sum (GPT2::take_loss). Final backward passes fire the
  // chunks' gradient-ready hooks.
  void run(const KernelContext& ctx, const std::vector<PipeInstr>& list, const Feed& feed, double dloss,
           PipelineStats& stats);

 private:
  struct Chunk {
    GPT2* model;
    int g;  // model chunk index
    bool first, last;
    std::vector<Tensor> tokens, targets;  // per slot, (B, T) int32
    std::vector<HostStaging> staging;     // per slot, when the slots are on a device: [tokens | targets] on the host
    std::vector<WorkPtr> slot_send;       // activation send in flight from each slot
    std::vector<int> free_slots;
    std::map<int, int> slot_of;           // microbatch -> slot
    std::vector<Tensor> grad_bufs;        // (R, C) received output gradients
    std::vector<int> free_grad;
    std::map<int, int> grad_of;           // microbatch -> grad buffer
    std::vector<Tensor> send_bufs;        // (R, C) outgoing input gradients
    std::vector<WorkPtr> send_work;
    int next_send = 0;
  };
  struct Posted {
    WorkPtr work;
  };
  int take_slot(Chunk& c, PipelineStats& stats);
  void post_receives(const std::vector<PipeInstr>& list, size_t from, PipelineStats& stats);
  void wait_recv(PipeOp op, int mb, int chunk, PipelineStats& stats);
  int tag(int dir, int mb, int dest_model_chunk) const { return (mb * p_ * v_ + dest_model_chunk) * 2 + dir; }

  std::vector<Chunk> chunks_;
  Communicator& pp_;
  int p_, rank_, v_, m_;
  int B_ = 0, T_ = 0;
  std::map<std::tuple<int, int, int>, WorkPtr> posted_;  // (op, mb, chunk) -> receive in flight
  size_t post_cursor_ = 0;  // next list index to consider for posting

};

}  // namespace xirang
