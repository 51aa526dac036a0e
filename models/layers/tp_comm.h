// models/layers/tp_comm.h: the tensor-parallel group as the layers use it.
//
// Megatron's conjugate pairs live here, each a no-op in a group of one:
//   - entering a column-parallel region: identity forward, all-reduce
//     backward; with sequence parallelism all-gather forward (gathered())
//     and reduce-scatter backward (reduce_rows()).
//   - leaving a row-parallel region: all-reduce forward, identity backward;
//     with sequence parallelism reduce-scatter forward (reduce_rows()) and
//     all-gather backward (full_rows()).
// Under sequence parallelism the residual stream holds R = N / P of the
// N = B * T token rows on each rank, else R = N. The (N, C) scratch the
// pairs need is carved once per chunk and shared by every layer.
//
//   TpComm tp(TensorParallel{&grid.tp(), true}, /*rows=*/B * T);
//   tp.layout(acts, C, dtype);
//   tp.begin_pass(ctx);                          // its stream, timeline and step clock
//   Tensor full = tp.gathered(ln_out);           // (R, C) -> (N, C)
//   tp.reduce_rows(tp.partial(), residual);      // (N, C) partial sums -> (R, C)
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "models/model.h"

namespace xirang {

class TpComm {
 public:
  // `rows`: N = B * T token rows of a microbatch.
  TpComm(const TensorParallel& tp, int64_t rows);

  int size() const { return size_; }
  int rank() const { return rank_; }
  bool split() const { return size_ > 1; }
  bool sequence_parallel() const { return sp_; }
  int64_t rows() const { return rows_; }              // N
  int64_t local_rows() const { return local_rows_; }  // R
  // A chunk laid out without its group (TensorParallel::size) cannot run.
  bool can_run() const { return size_ == 1 || group_ != nullptr; }

  // Carves the (N, width) scratch: partial sums, and under sequence
  // parallelism a gathered activation and a gathered gradient.
  void layout(Arena& acts, int64_t width, DType dtype);
  // The compute stream the pass's collectives join (null on the host), the
  // timeline that records them (trace spans, per-op times) and the step
  // clock whose TpComm part each collective is.
  void begin_pass(const KernelContext& ctx) {
    stream_ = ctx.cuda_stream;
    timeline_ = ctx.timeline;
    clock_ = ctx.clock;
  }

  // (N, width): row-parallel outputs and column-parallel input gradients before their reduction.
  Tensor partial() const { return partial_; }
  // Local rows (R, width) as all N rows: all-gathered under sequence
  // parallelism into scratch valid until the next call, else `local` itself.
  Tensor gathered(const Tensor& local);
  // Partial sums (N, width) reduced into the R local rows of `out`:
  // reduce-scatter under sequence parallelism, else an all-reduce in place
  // (`out` may be `partial` itself).
  void reduce_rows(Tensor partial, Tensor out);
  // The gradient of R local rows as the (N, width) gradient a row-parallel
  // region needs (all-gathered under sequence parallelism).
  Tensor full_rows(Tensor local);
  void all_reduce(Tensor t, ReduceOp op);

  // On a device, the collectives since the last call.
  TpCommTime take();

 private:
  Communicator* group_ = nullptr;
  int size_ = 1, rank_ = 0;
  bool sp_ = false;
  int64_t rows_ = 0, local_rows_ = 0;
  Tensor partial_;  // (N, width)
  Tensor gather_;   // (N, width) an activation gathered for one product (sequence parallel)
  Tensor grad_;     // (N, width) a gathered residual gradient (sequence parallel)
  // Joins `w` to the pass's stream (recording it on the timeline as `kind`, launched at t0).
  StepClock::Scope part(OpKind kind) const;
  void join(const WorkPtr& w, OpKind kind);

  std::vector<WorkPtr> device_work_;  // the collectives joined to a device stream since take()
  void* stream_ = nullptr;
  Timeline* timeline_ = nullptr;
  StepClock* clock_ = nullptr;
};

}  // namespace xirang
