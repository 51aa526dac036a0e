// runtime/step/schedule.h: pipeline schedules as data, and a simulator.
//
// A schedule is a pure function of (pp size, stage, microbatches, virtual
// stages) that returns one rank's ordered instruction list. The executor
// (runtime/step/pipeline.h) runs it, the simulator below runs every rank's list
// together with given costs, and the memory plan sizes activation slots from
// it: one representation for all three.
//
// The model is cut into p * v chunks of equal layer counts; chunk_map(kind,
// p, v) (runtime/config/schedule_rules.h) says which rank holds model chunk
// g as which local chunk: g % p and g / p (Megatron's interleaving; v = 1
// is the plain pipeline), or a V under zb_v. Instructions name the local
// chunk; activations flow from model chunk g to g + 1, gradients back
// (from one local chunk to the other at the V's turn: no transfer).
//
//   auto list = make_schedule(ScheduleKind::OneFOneB, /*p=*/4, /*rank=*/1, /*m=*/8, /*v=*/1);
//   SimCosts costs;  costs.forward = 1;  costs.backward = 2;
//   SimResult r = simulate(ScheduleKind::OneFOneB, 4, 8, 1, costs);
//   // r.bubble_fraction == 3.0 / 11
//
// zb_v places its two chunks per rank in a V instead (ChunkOrder::V).
//
// A zero-bubble schedule (zb_h1; Qi et al., "Zero Bubble Pipeline
// Parallelism", 2024) splits each backward into BackwardInput (B: the
// gradient the previous stage waits for) and BackwardWeight (W: the
// weight-gradient products, which only the optimizer needs), and defers
// W into what would be the cool-down's idle time. A microbatch's
// activations live from its forward to its B; what its W needs, the
// layer inputs of the weight products and their output gradients, until
// its W (slot_counts).
//
// zb_h2 (the paper's ZB-H2) runs the same parts with more warm-up forwards
// and a longer W lag: 2p - 1 microbatches in flight on every stage. Its
// stages form a parallelogram, stage r busy from r F to r F + m (F + B +
// W) when F = B = W: the bubble is gone only when steps follow each other
// without the optimizer's flush (the paper's post-validation, its Section
// 4); SimResult::span measures that, bubble_fraction the flushed step.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "models/placement.h"
#include "runtime/config/config.h"

namespace xirang {

// ScheduleKind, parse_schedule and schedule_name: runtime/config/config.h.

enum class PipeOp {
  RecvActivation,  // wait for the previous model chunk's output for (microbatch, chunk)
  Forward,
  SendActivation,  // to the next model chunk
  RecvGradient,    // wait for the next model chunk's input gradient
  Backward,        // the whole backward of (microbatch, chunk)
  SendGradient,    // to the previous model chunk
  BackwardInput,   // a split backward's first part: the input gradient (then SendGradient)
  BackwardWeight,  // its second part: the weight gradients, any time after BackwardInput
  ReduceGradients, // data-parallel and tied-embedding reductions (once, at the end)
  OptimizerStep,
};
const char* pipe_op_name(PipeOp op);

struct PipeInstr {
  PipeOp op;
  int microbatch = -1;
  int chunk = -1;  // local chunk (virtual stage) index on this rank
};

// One chunk's pass times: F, B (a split backward's input part) and W.
struct PassTimes {
  double forward = 1, input = 1, weight = 1;
};

// One rank's instruction list for one step. Throws a Config error when the
// combination is not supported (runtime/config/schedule_rules.h: interleaved
// needs v > 1 and m % p == 0, zb_v v == 2, the others v == 1; the zero-bubble
// kinds need p > 1).
std::vector<PipeInstr> make_schedule(ScheduleKind kind, int p, int rank, int m, int v);
// The same, with zb_v's list found for `times` (schedule_zbv.h: it is list
// scheduling over the passes' times, as in Qi et al.'s implementation; the
// plain form uses equal times). The other kinds ignore `times`.
std::vector<PipeInstr> make_schedule(ScheduleKind kind, int p, int rank, int m, int v, const PassTimes& times);

// Most microbatches a local chunk holds at once under this list, from each
// forward to its whole backward or its weight part.
int max_in_flight(const std::vector<PipeInstr>& list, int v);

// The slots of each pool a local chunk needs under this list (the most at
// once, over the list's chunks), found by walking it: activation slots
// from each forward to its Backward or BackwardInput, plus `receives_ahead`
// (activation receives the executor posts ahead of their forward); and for
// a split backward (ModelChunk::backward, MicrobatchSlots) input slots from
// each forward to its BackwardWeight and weight slots from each
// BackwardInput to its BackwardWeight. input and weight are 0 for a list
// that does not split its backward. Under zb_h1 rank r of p holds p input
// slots and r + 1 weight slots (m >= p).
struct SlotCounts {
  int activation = 0, input = 0, weight = 0;
};
SlotCounts slot_counts(const std::vector<PipeInstr>& list, int v, int receives_ahead);

struct SimCosts {
  double forward = 1;   // per microbatch for a whole stage (a chunk costs 1/v of it)
  double backward = 2;
  double weight_share = 0.5;  // of backward, a split backward's weight part W (the rest is B)
  double transfer = 0;  // per message
  // Optional per-rank costs (stages differ: the first holds the embedding,
  // the last the head); when given they replace forward and backward.
  std::vector<double> forward_per_rank, backward_per_rank;
};

struct SimResult {
  bool ok = false;
  std::string error;                  // deadlock or a violated dependency, when !ok
  double makespan = 0;
  std::vector<double> busy;           // compute time per rank
  double bubble_fraction = 0;         // mean over ranks of idle / makespan
  std::vector<int> peak_in_flight;    // per rank: most microbatch-chunks with live activations
  // Per rank: from its first compute's start to its last's end. When steps
  // overlap without a flush (each rank's optimizer step waits only for its
  // own work), the step repeats every max(span) and rank r idles
  // max(span) - busy[r] per step.
  std::vector<double> span;
};

// Runs all p ranks' lists together: sends take no rank time and arrive
// `transfer` later; a receive blocks until its message has arrived. zb_v's
// lists are made for the scalar costs (make_schedule with PassTimes).
SimResult simulate(ScheduleKind kind, int p, int m, int v, const SimCosts& costs);
// The bubble fraction the analysis predicts with transfer = 0:
// (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1)
// interleaved; zb_h1 and (flushed) zb_h2 at forward = B = W: (p - 1) / (3 m + p - 1).
double analytic_bubble(ScheduleKind kind, int p, int m, int v);
// Each stage's idle time per step with transfer = 0, m >= p microbatches
// and stage times F, B, W (the paper's Table 2): (p - 1)(F + B + W) for
// 1F1B and GPipe, (p - 1)(F + B - W) for zb_h1 when W <= F (a longer W
// cannot hide more than a forward's gap: (p - 1) B). zb_h2 (m >= 2p - 1,
// W <= F and 2W <= F + B, else a failed check): (p - 1)(F + B - 2W) per step
// without the flush (max(span) - busy); the flushed step idles
// (p - 1) max(F, F + B - 2W), the last stage's first forward waiting
// (p - 1) F at least.
double bubble_time(ScheduleKind kind, int p, double f, double b, double w);

}  // namespace xirang
