// runtime/step/pipeline.h: runs one rank's pipeline instruction list.
//
// The executor owns this rank's model chunks (one ModelChunk per virtual stage)
// and two pipeline channels: activations travel forward on one, input
// gradients backward on the other. The chunk map (models/placement.h) says
// which rank holds each neighbouring model chunk: round-robin, the
// neighbours are rank r-1 and r+1; in zb_v's V the second chunk's are
// reversed (r+1 before, r-1 after) and the turn of the V (model chunks p-1
// and p on rank p-1) is a local hand-off: the activation and the gradient
// are copied between the two chunks, no transfer. Receives are posted ahead of the
// instruction that needs them (activations straight into the activation
// slot the forward will use), sends never block compute (an activation is
// sent from its slot, which stays untouched until that microbatch's
// backward; an input gradient from a small pool of send buffers). Each
// instruction runs in its part of the step clock (KernelContext::clock,
// core/step_clock.h): passes are forward or backward, the feed data wait,
// waiting for a neighbour's activation or gradient pipeline bubble, waiting
// for one of our own sends to finish exposed pipeline communication. The
// channels are communicators of their own, so their transfers never queue
// behind data-parallel buckets.
//
// Every wait is a Work::join on the compute stream: a host wait on the CPU
// backend; on a device the compute stream waits for the transfer and the
// host goes on queuing (no host synchronization in the step).
//
// Channels that match sends and receives by order (NCCL; OrderedLink, its
// emulation over MPI) run each channel's operations one at a time, and a
// send waits until the peer's matching receive is at the head of its queue.
// One queue shared by a rank's sends and receives deadlocks as soon as two
// ranks each wait to send to the other (the interleaved schedule's ring does
// that), so a rank has four queues (PipeChannels): activations out to r+1,
// activations in from r-1, and the same for gradients, each in schedule
// order. The edge from rank e to e+1 is one order-matched channel shared by
// its two ends (e's send queue, e+1's receive queue); edges are coloured so
// that a rank's send and receive queues are different channels
// (pipe_edge_color). The layout-equivalence tests run every schedule over
// OrderedLink to show that this never deadlocks.
//
//   PipelineExecutor exec(chunks, PipeChannels::shared(grid.pp()), chunk_map(kind, p, v), rank, m);  // MPI: tags
//   exec.layout(arena);                         // measuring, then real
//   exec.run(ctx, list, feed, dloss);             // host time: ctx.clock's parts
//   exec.take_device_times(device);               // on a device, after the step's host wait
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/arena.h"
#include "core/device_events.h"
#include "models/model.h"
#include "runtime/step/schedule.h"

namespace xirang {

// One pipeline rank's transfer queues (they may all be one communicator
// that matches by tag, as MPI does; zb_v needs that: its second chunk
// sends activations to r-1 and gradients to r+1 on the same queues).
struct PipeChannels {
  Communicator* act_send = nullptr;   // activations to rank r+1
  Communicator* act_recv = nullptr;   // activations from rank r-1
  Communicator* grad_send = nullptr;  // input gradients to rank r-1
  Communicator* grad_recv = nullptr;  // output gradients from rank r+1
  static PipeChannels shared(Communicator& c) { return {&c, &c, &c, &c}; }
};

// Order-matched channels per direction: the edge from pipeline rank e to
// e+1 (mod p) is channel pipe_edge_color(e, p) of pipe_colors(p): e mod 2,
// and a third colour for the wrap-around edge when p is odd, so that every
// rank sends and receives on different channels.
inline int pipe_colors(int p) { return p % 2 == 0 ? 2 : 3; }
inline int pipe_edge_color(int e, int p) { return p % 2 == 1 && e == p - 1 ? 2 : e % 2; }
// Rank r's queues from channels act[color] and grad[color] (pipe_colors(p) each).
PipeChannels colored_pipe_channels(int rank, int p, const std::vector<Communicator*>& act,
                                   const std::vector<Communicator*>& grad);

// The step's compute on a device, from the stream's timing events (on the
// CPU the passes run in the host's time: the step clock's parts).
struct DeviceTimes {
  double forward_ms = 0;   // forward passes, less the tensor-parallel collectives inside them
  double backward_ms = 0;  // backward passes, likewise
  double tp_comm_ms = 0;   // the collectives' device time
  double bubble_ms = 0;    // the stream idle between the step's first and last pass
};

// The device time of each forward and backward pass: on a device the call
// only queues a pass, so its span is a pair of timing events on the compute
// stream, read once the step's work has completed, and the stream's idle
// time between the step's first and last span (waiting for a neighbour's
// transfer or an upload) is the device's pipeline bubble. On the host (a
// null stream) nothing is recorded.
class ComputeSpans {
 public:
  enum Kind { Forward, Backward };
  // `events`: the step clock's pool, which a device needs (null on the host).
  void begin(void* stream, DeviceEvents* events);
  // `microbatch` and `chunk` label the span in a trace. `tp_work`: the
  // pass's tensor-parallel collectives, whose device time take() moves
  // from the pass to tp_comm_ms.
  void end(void* stream, Kind kind, int microbatch = -1, int chunk = -1, std::vector<WorkPtr> tp_work = {});
  // Adds the spans since the last call to `times` and starts over; only
  // after the spans' work has completed. When `tl` is tracing, the spans go
  // to its Device track, placed on the host clock by a reference event
  // recorded (and waited for) now.
  void take(DeviceTimes& times, Timeline* tl = nullptr);

 private:
  struct Pass {
    int start = -1, end = -1;  // the pool's events around it
    Kind kind = Forward;
    int microbatch = -1, chunk = -1;
    std::vector<WorkPtr> tp_work;
  };
  DeviceEvents* events_ = nullptr;
  std::vector<Pass> passes_;  // reused every step: events are taken during the first only
  size_t used_ = 0;           // passes recorded since the last take
  void* stream_ = nullptr;
  int reference_ = -1;        // places the spans on the host clock (taken when first traced)
};

class PipelineExecutor {
 public:
  // Fills the (B, T) int32 tokens and targets of microbatch `mb` where they
  // live (an activation slot, on the chunks' device); either is undefined
  // when this rank's chunks do not need it (only the first stage reads
  // tokens, only the last reads targets). The loader does the upload
  // (PrefetchLoader::next with tensors): the executor only schedules.
  using Feed = std::function<void(int mb, const Tensor& tokens, const Tensor& targets)>;

  // `chunks[c]` is local chunk c (model chunk map.model_chunk(rank, c)); m microbatches per step.
  PipelineExecutor(std::vector<ModelChunk*> chunks, const PipeChannels& channels, const ChunkMap& map, int rank, int m);
  // Whether local chunk `c` of a rank fills (B, T) token or target slots of its own: the first model
  // chunk takes the tokens; the last the targets, unless its rank also holds the first (zb_v's V):
  // then the first chunk's forward takes both in one read of the loader, which hands out each
  // microbatch once, and the head's forward reads them there (the first chunk's slot is held
  // until its backward, after the head's forward of the same microbatch).
  static bool holds_tokens(const ChunkMap& map, int rank, int c);
  static bool holds_targets(const ChunkMap& map, int rank, int c);
  // Carves the token/target buffers of every activation slot and the gradient buffers.
  void layout(Arena& a);
  // Runs `list` up to ReduceGradients. The microbatch losses collect in the
  // head chunk's loss sum (ModelChunk::take_loss). Final backward passes fire the
  // chunks' gradient-ready hooks.
  void run(const KernelContext& ctx, const std::vector<PipeInstr>& list, const Feed& feed, double dloss);
  // On a device run() only queues the passes: this adds their device times
  // once the step's work has completed (after the step's host wait).
  void take_device_times(DeviceTimes& times) {
    spans_.take(times, tl_);
    record_transfers();
  }
  // On a device: waits on the host, with each channel's timeout, for the
  // step's last sends (the compute stream only joined them), so that a
  // neighbour that died ends the step with an error rather than a stalled
  // stream. Call before the step's host synchronization.
  void wait_sends() {
    for (auto& w : in_flight_) w->wait();
    in_flight_.clear();
  }
  // The timeline of the step in progress (KernelContext::timeline).
  Timeline* timeline() const { return tl_; }

 private:
  struct Chunk {
    ModelChunk* model;
    int g;  // model chunk index
    bool first, last;
    int prev_rank = -1, next_rank = -1;  // the ranks of model chunks g - 1 and g + 1 (-1: none)
    int prev_local = -1, next_local = -1;  // their local index when on this rank (the V's turn), else -1
    bool own_tokens = false, own_targets = false;  // holds_tokens, holds_targets
    std::vector<Tensor> tokens, targets;  // per slot, (B, T) int32
    std::vector<WorkPtr> slot_send;       // activation send in flight from each slot
    std::vector<int> free_slots;
    std::map<int, int> slot_of;           // microbatch -> activation slot (its forward to its backward or B)
    // A split backward's pools (ModelChunk::backward, MicrobatchSlots):
    bool split = false;
    std::vector<int> free_inputs, free_weights;
    std::map<int, int> input_of;          // microbatch -> input slot (its forward to its W)
    std::map<int, int> weight_of;         // microbatch -> weight slot (its B to its W)
    std::vector<Tensor> grad_bufs;        // (R, C) received output gradients
    std::vector<int> free_grad;
    std::map<int, int> grad_of;           // microbatch -> grad buffer
    std::vector<Tensor> send_bufs;        // (R, C) outgoing input gradients
    std::vector<WorkPtr> send_work;
    int next_send = 0;
  };
  // A transfer in flight and its span (posted to completed) for the
  // timeline: completed is posted + the transfer's duration, known once it has.
  struct Transfer {
    WorkPtr work;
    Span span;
    OpKind kind;
  };
  void note_transfer(const WorkPtr& w, const char* name, Track track, OpKind kind, int mb, int chunk,
                     const Tensor& t, double posted);
  // Adds the step's finished transfers to the timeline (spans, per-op times).
  void record_transfers();
  // One per instruction kind.
  void receive(const std::vector<PipeInstr>& list, size_t i);
  void forward(const KernelContext& ctx, Chunk& c, int mb, const Feed& feed, double dloss);
  void send_activation(Chunk& c, int mb);
  void backward(const KernelContext& ctx, Chunk& c, int mb, BackwardPart part);
  // Runs one pass of `c` in its part of the step clock, between a device span's begin and end.
  template <class Pass>
  void timed_pass(Chunk& c, ComputeSpans::Kind kind, const char* name, int mb, Pass&& pass);
  void send_gradient(const KernelContext& ctx, Chunk& c, int mb);
  void join_sends();
  // Joins a send of ours in flight: exposed pipeline communication.
  void join_send(WorkPtr& w, int chunk);
  int take_slot(Chunk& c);
  // The split backward's slots of microbatch `mb` (input, weight) taken from their pool when `take`.
  int input_slot(Chunk& c, int mb, bool take);
  int weight_slot(Chunk& c, int mb, bool take);
  void post_receives(const std::vector<PipeInstr>& list, size_t from);
  void wait_recv(PipeOp op, int mb, int chunk);
  int tag(int dir, int mb, int dest_model_chunk) const { return (mb * p_ * v_ + dest_model_chunk) * 2 + dir; }

  std::vector<Chunk> chunks_;
  PipeChannels ch_;
  void* stream_ = nullptr;  // the compute stream of the step in progress (null on the host)
  ComputeSpans spans_;
  std::vector<WorkPtr> in_flight_;  // the step's last sends, joined on a device (wait_sends)
  Timeline* tl_ = nullptr;          // the step's timeline (null: none)
  StepClock* clock_ = nullptr;      // the step's clock (null: none)
  std::vector<Transfer> transfers_; // the step's transfers, for the timeline
  ChunkMap map_;
  int p_, rank_, v_, m_;
  int B_ = 0, T_ = 0;  // T_: the rows of each sequence on this rank (T / cp)
  std::map<std::tuple<int, int, int>, WorkPtr> posted_;  // (op, mb, chunk) -> receive in flight
  size_t post_cursor_ = 0;  // next list index to consider for posting

};

}  // namespace xirang
