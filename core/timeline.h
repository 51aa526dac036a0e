// core/timeline.h: what a step's time went to, at two grains: spans for the
// trace (metrics.trace: one row per kind of activity, Chrome trace-event
// JSON written by runtime/observe/trace_writer.h) and time per kind of op
// (metrics.op_profile: matmul, attention, ..., communication by group and
// collective, summed per step into metrics.jsonl).
//
// A Timeline is passed down explicitly, like the stream: KernelContext
// carries a pointer to it, and the runtime's parts that run outside an op
// (the executor, GradSync, TpComm, the checkpointer) take one. A null
// pointer, or a timeline with both parts off, records nothing: the scopes
// below test one pointer and one flag, so tracing off costs a branch.
//
//   Timeline tl;  tl.set_tracing(true);
//   { SpanScope s(&tl, "forward", Track::Main, mb, chunk);  ...  }   // a span [now, end of scope)
//   { OpScope op(ctx.timeline, ctx.cuda_stream, OpKind::Matmul); ... }  // the op's time, nested ops once
//   std::vector<Span> spans = tl.take_spans();
//   OpTimes ops = tl.take_ops();  // on a device after the step's work has completed
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "core/clock.h"
#include "core/device_events.h"

namespace xirang {

// The row of the rank's process a span is drawn on. Spans on Main nest (a
// forward holds its tensor-parallel collectives); transfers overlap one
// another and the trace writer spreads them over lanes of their track.
enum class Track : uint8_t {
  Main,        // the training thread: step, passes, waits, optimizer, evaluation, checkpoint stall
  DpComm,      // data-parallel bucket reductions and ZeRO gathers, launch to completion
  PipeSend,    // pipeline sends, posted to completed
  PipeRecv,    // pipeline receives, posted to completed
  Checkpoint,  // the checkpoint writer thread
  Device,      // passes as the device ran them (CUDA events on the compute stream)
};
constexpr int kTrackCount = 6;
const char* track_name(Track t);

struct Span {
  const char* name = "";  // a string with static storage (a literal)
  Track track = Track::Main;
  int32_t microbatch = -1, chunk = -1, index = -1;  // -1: not applicable; index: bucket, step, ...
  int64_t bytes = -1;
  double t0 = 0, t1 = 0;  // seconds on the steady clock (now_seconds)
};

// Kinds of op for the per-op profile. Compute kinds are the kernels' own
// time; communication kinds are a collective's time from submission to
// completion (overlapped with compute or not), by group and collective.
enum class OpKind : uint8_t {
  Matmul,
  Attention,
  Norm,
  Loss,
  Embedding,
  Elementwise,
  Optimizer,
  TpAllReduce,
  TpAllGather,
  TpReduceScatter,
  DpAllReduce,
  DpReduceScatter,
  DpAllGather,
  PpSend,
  PpRecv,
  TiedAllReduce,
  CpAllGather,
  CpReduceScatter,
};
constexpr int kOpKindCount = 18;
// "matmul", ..., "tp_all_reduce", ...: the keys of metrics.jsonl's op_ms.
const char* op_kind_name(OpKind k);
bool op_kind_is_comm(OpKind k);

struct OpTimes {
  std::array<double, kOpKindCount> ms{};
  std::array<int64_t, kOpKindCount> calls{};
};

class Timeline {
 public:
  Timeline();
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Spans are kept while tracing is on (a trace window); ops are summed while profiling is on.
  void set_tracing(bool on) { tracing_.store(on, std::memory_order_relaxed); }
  bool tracing() const { return tracing_.load(std::memory_order_relaxed); }
  void set_profiling(bool on) { profiling_ = on; }
  bool profiling() const { return profiling_; }

  // Any thread (the checkpoint writer records from its own).
  void add_span(const Span& s);
  std::vector<Span> take_spans();
  // SpanScopes begun while tracing and not yet ended: after a step, those
  // of other threads (a checkpoint write still in progress).
  int open_spans() const { return open_spans_.load(std::memory_order_relaxed); }
  void span_opened() { open_spans_.fetch_add(1, std::memory_order_relaxed); }
  void span_closed() { open_spans_.fetch_sub(1, std::memory_order_relaxed); }

  // The training thread. An op measured on the host (its call's wall time).
  void add_op_ms(OpKind k, double ms);
  // A time known later (a transfer's duration, valid once it completed):
  // `ms` is called by take_ops().
  void add_op_later(OpKind k, std::function<double()> ms);
  // Device ops: a pair of timing events around the op on `stream`, read by
  // take_ops(), from `events` (the step clock's pool; a timeline with none
  // set makes its own on first use).
  void set_device_events(DeviceEvents* events) { events_ = events; }
  void begin_device_op(void* stream);
  void end_device_op(void* stream, OpKind k);
  // The ops since the last call. On a device only after their work has completed.
  OpTimes take_ops();

  // Nesting of OpScopes (an op implemented with other ops is counted once, as itself).
  int& op_depth() { return op_depth_; }

 private:
  std::atomic<bool> tracing_{false};
  std::atomic<int> open_spans_{0};
  bool profiling_ = false;
  std::mutex mu_;
  std::vector<Span> spans_;
  OpTimes ops_;
  std::vector<std::pair<OpKind, std::function<double()>>> later_;
  DeviceEvents* events_ = nullptr;
  std::unique_ptr<DeviceEvents> own_events_;
  std::vector<int> op_events_;  // op i's start and end at 2i, 2i + 1 (reused every step)
  std::vector<OpKind> op_kinds_;
  size_t device_ops_ = 0;       // recorded since the last take_ops
  int op_depth_ = 0;
};

// A span from construction to destruction, when `tl` is tracing.
class SpanScope {
 public:
  SpanScope(Timeline* tl, const char* name, Track track = Track::Main, int microbatch = -1, int chunk = -1,
            int index = -1)
      : tl_(tl && tl->tracing() ? tl : nullptr) {
    if (tl_) {
      s_ = Span{name, track, microbatch, chunk, index, -1, now_seconds(), 0};
      tl_->span_opened();
    }
  }
  ~SpanScope() { end(); }
  // Ends the span before the scope does.
  void end() {
    if (tl_) {
      s_.t1 = now_seconds();
      tl_->add_span(s_);
      tl_->span_closed();
      tl_ = nullptr;
    }
  }
  SpanScope(const SpanScope&) = delete;
  SpanScope& operator=(const SpanScope&) = delete;

 private:
  Timeline* tl_;
  Span s_;
};

// Records a finished interval [t0, t1] when `tl` is tracing.
inline void add_span(Timeline* tl, const char* name, Track track, double t0, double t1, int microbatch = -1,
                     int chunk = -1, int index = -1, int64_t bytes = -1) {
  if (tl && tl->tracing()) tl->add_span(Span{name, track, microbatch, chunk, index, bytes, t0, t1});
}

// One op's time when `tl` is profiling: the call's wall time on the host
// (stream null), a pair of timing events on a device stream. Nested scopes
// count only the outermost.
class OpScope {
 public:
  OpScope(Timeline* tl, void* stream, OpKind k) : tl_(tl && tl->profiling() ? tl : nullptr), stream_(stream), k_(k) {
    if (!tl_ || tl_->op_depth()++ > 0) return;
    if (stream_) tl_->begin_device_op(stream_);
    else t0_ = now_seconds();
  }
  ~OpScope() {
    if (!tl_ || --tl_->op_depth() > 0) return;
    if (stream_) tl_->end_device_op(stream_, k_);
    else tl_->add_op_ms(k_, (now_seconds() - t0_) * 1e3);
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  Timeline* tl_;
  void* stream_;
  OpKind k_;
  double t0_ = 0;
};

}  // namespace xirang
