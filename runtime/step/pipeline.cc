#include "runtime/step/pipeline.h"

#include <algorithm>

#include "core/clock.h"
#include "core/device_memory.h"
#include "core/error.h"

namespace xirang {

void ComputeSpans::begin(void* stream, DeviceEvents* events) {
  if (!stream) return;
  XR_CHECK(events, "pipeline: passes on a device stream need the step clock's device events");
  events_ = events;
  stream_ = stream;
  if (passes_.size() == used_) {  // grows during the first step only
    Pass p;
    p.start = events->take();
    p.end = events->take();
    passes_.push_back(std::move(p));
  }
  events->record(passes_[used_].start, stream);
}

void ComputeSpans::end(void* stream, Kind kind, int microbatch, int chunk, std::vector<WorkPtr> tp_work) {
  if (!stream) return;
  Pass& p = passes_[used_++];
  events_->record(p.end, stream);
  p.kind = kind;
  p.microbatch = microbatch;
  p.chunk = chunk;
  p.tp_work = std::move(tp_work);
}

void ComputeSpans::take(DeviceTimes& times, Timeline* tl) {
  if (used_ == 0) return;
  DeviceEvents& ev = *events_;
  const bool trace = tl && tl->tracing();
  double ref_s = 0;
  if (trace) {  // the stream has finished the step's passes: the reference completes at once
    if (reference_ < 0) reference_ = ev.take();
    ev.record(reference_, stream_);
    ev.wait(reference_);
    ref_s = now_seconds();
  }
  double busy = 0;
  for (size_t i = 0; i < used_; ++i) {
    Pass& p = passes_[i];
    const double ms = ev.ms(p.start, p.end);
    // The stream waited for the pass's collectives inside the span: their time is tp_comm_ms.
    double tp_ms = 0;
    for (const WorkPtr& w : p.tp_work) tp_ms += w->duration_ms();
    p.tp_work.clear();
    tp_ms = std::min(tp_ms, ms);
    (p.kind == Forward ? times.forward_ms : times.backward_ms) += ms - tp_ms;
    times.tp_comm_ms += tp_ms;
    busy += ms;
    if (trace) {
      const double t1 = ref_s - ev.ms(p.end, reference_) / 1e3;
      add_span(tl, p.kind == Forward ? "forward" : "backward", Track::Device, t1 - ms / 1e3, t1, p.microbatch,
               p.chunk);
    }
  }
  times.bubble_ms += std::max(0.0, ev.ms(passes_[0].start, passes_[used_ - 1].end) - busy);
  used_ = 0;
}

namespace {
constexpr int kGradBuffers = 2;  // received output gradients: the one in use and one posted ahead
constexpr int kSendBuffers = 2;  // outgoing input gradients in flight
constexpr int kLookahead = 2;    // receives posted ahead of the instruction that needs them
}  // namespace

PipeChannels colored_pipe_channels(int rank, int p, const std::vector<Communicator*>& act,
                                   const std::vector<Communicator*>& grad) {
  XR_CHECK(int(act.size()) == pipe_colors(p) && int(grad.size()) == pipe_colors(p), "pipeline: ", pipe_colors(p),
           " channels per direction expected for ", p, " stages");
  const int out = pipe_edge_color(rank, p), in = pipe_edge_color((rank + p - 1) % p, p);
  return {act[size_t(out)], act[size_t(in)], grad[size_t(in)], grad[size_t(out)]};
}

bool PipelineExecutor::holds_tokens(const ChunkMap& map, int rank, int c) { return map.model_chunk(rank, c) == 0; }

bool PipelineExecutor::holds_targets(const ChunkMap& map, int rank, int c) {
  const int g = map.model_chunk(rank, c), last = map.chunks() - 1;
  if (g == 0) return map.rank_of(last) == rank;  // one chunk holding both, or the V's rank 0
  return g == last && map.rank_of(0) != rank;
}

PipelineExecutor::PipelineExecutor(std::vector<ModelChunk*> chunks, const PipeChannels& channels, const ChunkMap& map,
                                   int rank, int m)
    : ch_(channels), map_(map), p_(map.p), rank_(rank), v_(map.v), m_(m) {
  XR_CHECK(ch_.act_send && ch_.act_recv && ch_.grad_send && ch_.grad_recv, "pipeline: a channel is missing");
  XR_CHECK(int(chunks.size()) == v_, "executor needs ", v_, " chunks, got ", chunks.size());
  for (int c = 0; c < v_; ++c) {
    Chunk ch;
    ch.model = chunks[size_t(c)];
    ch.g = map.model_chunk(rank, c);
    ch.first = ch.g == 0;
    ch.last = ch.g == map.chunks() - 1;
    if (!ch.first) {
      ch.prev_rank = map.rank_of(ch.g - 1);
      if (ch.prev_rank == rank) ch.prev_local = map.local_of(ch.g - 1);
    }
    if (!ch.last) {
      ch.next_rank = map.rank_of(ch.g + 1);
      if (ch.next_rank == rank) ch.next_local = map.local_of(ch.g + 1);
    }
    ch.own_tokens = holds_tokens(map, rank, c);
    ch.own_targets = holds_targets(map, rank, c);
    XR_CHECK(ch.model->placement().has_embedding == ch.first && ch.model->placement().has_head == ch.last,
             "chunk ", c, " of rank ", rank, " does not match its place in the pipeline");
    chunks_.push_back(std::move(ch));
  }
  B_ = chunks[0]->batch().micro_batch;
  // A cp rank's rows of each sequence (T / cp; all T when cp = 1): what the loader fills.
  const ChunkBatch& batch = chunks[0]->batch();
  T_ = int(batch.cp.split(batch.seq_len).local_rows());
}

void PipelineExecutor::layout(Arena& a) {
  for (Chunk& c : chunks_) {
    const int slots = c.model->batch().activation_slots;
    c.tokens.clear();
    c.targets.clear();
    c.free_slots.clear();
    for (int s = 0; s < slots; ++s) {
      if (c.own_tokens) c.tokens.push_back(a.alloc({B_, T_}, DType::I32, "pipeline tokens"));
      if (c.own_targets) c.targets.push_back(a.alloc({B_, T_}, DType::I32, "pipeline targets"));
      c.free_slots.push_back(slots - 1 - s);  // pop_back hands out slot 0 first
    }
    c.slot_send.assign(size_t(slots), nullptr);
    c.split = c.model->splits_backward();
    c.free_inputs.clear();
    c.free_weights.clear();
    c.input_of.clear();
    c.weight_of.clear();
    if (c.split) {
      const ChunkBatch& b = c.model->batch();
      for (int s = b.inputs() - 1; s >= 0; --s) c.free_inputs.push_back(s);
      for (int s = b.weights() - 1; s >= 0; --s) c.free_weights.push_back(s);
    }
    const Shape rows = c.model->input_grad().shape();
    c.grad_bufs.clear();
    c.send_bufs.clear();
    c.free_grad.clear();
    if (!c.last)
      for (int i = 0; i < kGradBuffers; ++i) {
        c.grad_bufs.push_back(a.alloc(rows, c.model->dtype(), "received output gradient"));
        c.free_grad.push_back(kGradBuffers - 1 - i);
      }
    if (!c.first)
      for (int i = 0; i < kSendBuffers; ++i) c.send_bufs.push_back(a.alloc(rows, c.model->dtype(), "input gradient send"));
    c.send_work.assign(c.send_bufs.size(), nullptr);
  }
}

void PipelineExecutor::join_send(WorkPtr& w, int chunk) {
  StepClock::Scope part(clock_, StepPart::PpCommExposed, {tl_, "wait_send", Track::Main, -1, chunk});
  w->join(stream_);
}

int PipelineExecutor::take_slot(Chunk& c) {
  XR_CHECK(!c.free_slots.empty(), "pipeline: no free activation slot on model chunk ", c.g);
  const int s = c.free_slots.back();
  c.free_slots.pop_back();
  // The slot's previous activation may still be on its way to the next stage.
  if (c.slot_send[size_t(s)]) {
    join_send(c.slot_send[size_t(s)], c.g);
    c.slot_send[size_t(s)].reset();
  }
  return s;
}

int PipelineExecutor::input_slot(Chunk& c, int mb, bool take) {
  if (!take) return c.input_of.at(mb);
  XR_CHECK(!c.free_inputs.empty(), "pipeline: no free input slot on model chunk ", c.g, " for microbatch ", mb);
  const int s = c.free_inputs.back();
  c.free_inputs.pop_back();
  return c.input_of[mb] = s;
}

int PipelineExecutor::weight_slot(Chunk& c, int mb, bool take) {
  if (!take) return c.weight_of.at(mb);
  XR_CHECK(!c.free_weights.empty(), "pipeline: no free weight slot on model chunk ", c.g, " for microbatch ", mb);
  const int s = c.free_weights.back();
  c.free_weights.pop_back();
  return c.weight_of[mb] = s;
}

// Posts, in list order, the next receives whose destination buffer is free.
void PipelineExecutor::post_receives(const std::vector<PipeInstr>& list, size_t from) {
  post_cursor_ = std::max(post_cursor_, from);
  int ahead = 0;
  for (const auto& [key, w] : posted_) (void)key, ++ahead;
  while (post_cursor_ < list.size() && ahead < kLookahead) {
    const PipeInstr& in = list[post_cursor_];
    // A hand-off between this rank's chunks (the V's turn) is no transfer: receive() copies it.
    const bool local = in.chunk >= 0 && (in.op == PipeOp::RecvActivation ? chunks_[size_t(in.chunk)].prev_local >= 0
                                                                          : chunks_[size_t(in.chunk)].next_local >= 0);
    if (!local && in.op == PipeOp::RecvActivation) {
      Chunk& c = chunks_[size_t(in.chunk)];
      if (c.free_slots.empty()) return;  // posted once a backward frees a slot
      const int s = take_slot(c);
      c.slot_of[in.microbatch] = s;
      const double t0 = now_seconds();
      WorkPtr w = ch_.act_recv->recv_async(c.model->stage_input(s), c.prev_rank, tag(0, in.microbatch, c.g));
      note_transfer(w, "recv_activation", Track::PipeRecv, OpKind::PpRecv, in.microbatch, c.g, c.model->stage_input(s), t0);
      posted_[{0, in.microbatch, in.chunk}] = std::move(w);
      ++ahead;
    } else if (!local && in.op == PipeOp::RecvGradient) {
      Chunk& c = chunks_[size_t(in.chunk)];
      if (c.free_grad.empty()) return;
      const int b = c.free_grad.back();
      c.free_grad.pop_back();
      c.grad_of[in.microbatch] = b;
      const double t0 = now_seconds();
      WorkPtr w = ch_.grad_recv->recv_async(c.grad_bufs[size_t(b)], c.next_rank, tag(1, in.microbatch, c.g));
      note_transfer(w, "recv_gradient", Track::PipeRecv, OpKind::PpRecv, in.microbatch, c.g, c.grad_bufs[size_t(b)], t0);
      posted_[{1, in.microbatch, in.chunk}] = std::move(w);
      ++ahead;
    }
    ++post_cursor_;
  }
}

void PipelineExecutor::wait_recv(PipeOp op, int mb, int chunk) {
  auto it = posted_.find({op == PipeOp::RecvActivation ? 0 : 1, mb, chunk});
  XR_CHECK(it != posted_.end(), "pipeline: ", pipe_op_name(op), " of microbatch ", mb, " was not posted");
  StepClock::Scope part(clock_, StepPart::PpBubble,
                        {tl_, op == PipeOp::RecvActivation ? "wait_activation" : "wait_gradient", Track::Main, mb,
                         chunks_[size_t(chunk)].g});
  it->second->join(stream_);
  posted_.erase(it);
}

void PipelineExecutor::run(const KernelContext& ctx, const std::vector<PipeInstr>& list, const Feed& feed,
                           double dloss) {
  posted_.clear();
  post_cursor_ = 0;
  stream_ = ctx.cuda_stream;
  tl_ = ctx.timeline;
  clock_ = ctx.clock;
  in_flight_.clear();
  transfers_.clear();
  for (size_t i = 0; i < list.size(); ++i) {
    post_receives(list, i);
    const PipeInstr& in = list[i];
    if (in.op == PipeOp::ReduceGradients || in.op == PipeOp::OptimizerStep) break;
    Chunk& c = chunks_[size_t(in.chunk)];
    switch (in.op) {
      case PipeOp::RecvActivation:
      case PipeOp::RecvGradient: receive(list, i); break;
      case PipeOp::Forward: forward(ctx, c, in.microbatch, feed, dloss); break;
      case PipeOp::SendActivation: send_activation(c, in.microbatch); break;
      case PipeOp::Backward: backward(ctx, c, in.microbatch, BackwardPart::Full); break;
      case PipeOp::BackwardInput: backward(ctx, c, in.microbatch, BackwardPart::InputGrad); break;
      case PipeOp::BackwardWeight: backward(ctx, c, in.microbatch, BackwardPart::WeightGrad); break;
      case PipeOp::SendGradient: send_gradient(ctx, c, in.microbatch); break;
      default: break;
    }
  }
  join_sends();
  XR_CHECK(posted_.empty(), "pipeline: ", posted_.size(), " receive(s) left posted at the end of the step");
  if (!stream_) record_transfers();
}

void PipelineExecutor::note_transfer(const WorkPtr& w, const char* name, Track track, OpKind kind, int mb, int chunk,
                                     const Tensor& t, double posted) {
  if (tl_ && (tl_->tracing() || tl_->profiling()))
    transfers_.push_back({w, Span{name, track, mb, chunk, -1, int64_t(t.bytes()), posted, posted}, kind});
}

void PipelineExecutor::record_transfers() {
  for (Transfer& t : transfers_) {
    const double ms = t.work->duration_ms();
    if (tl_->profiling()) tl_->add_op_ms(t.kind, ms);
    t.span.t1 = t.span.t0 + ms / 1e3;
    if (tl_->tracing()) tl_->add_span(t.span);
  }
  transfers_.clear();
}

void PipelineExecutor::receive(const std::vector<PipeInstr>& list, size_t i) {
  const PipeInstr& in = list[i];
  Chunk& c = chunks_[size_t(in.chunk)];
  if (in.op == PipeOp::RecvActivation && c.prev_local >= 0) {
    // The previous chunk's output stays in its slot until its backward, after this chunk's.
    Chunk& from = chunks_[size_t(c.prev_local)];
    const int s = take_slot(c);
    c.slot_of[in.microbatch] = s;
    copy_tensor(c.model->stage_input(s), from.model->stage_output(from.slot_of.at(in.microbatch)), stream_, false);
    return;
  }
  if (in.op == PipeOp::RecvGradient && c.next_local >= 0) {  // copied by the next chunk's send_gradient
    XR_CHECK(c.grad_of.count(in.microbatch), "pipeline: the gradient of microbatch ", in.microbatch,
             " was not handed from model chunk ", c.g + 1, " to ", c.g, " before its receive");
    return;
  }
  // Normally posted ahead; a receive is posted here at the latest.
  if (!posted_.count({in.op == PipeOp::RecvActivation ? 0 : 1, in.microbatch, in.chunk})) {
    post_cursor_ = i;
    post_receives(list, i);
  }
  wait_recv(in.op, in.microbatch, in.chunk);
}

template <class Pass>
void PipelineExecutor::timed_pass(Chunk& c, ComputeSpans::Kind kind, const char* name, int mb, Pass&& pass) {
  // The host span: on a device the time the host took to queue the pass.
  StepClock::Scope part(clock_, kind == ComputeSpans::Forward ? StepPart::Forward : StepPart::Backward,
                        {tl_, name, Track::Main, mb, c.g});
  spans_.begin(stream_, clock_ ? &clock_->device_events() : nullptr);
  pass();
  spans_.end(stream_, kind, mb, c.g, c.model->take_tp_comm().device_work);
}

void PipelineExecutor::forward(const KernelContext& ctx, Chunk& c, int mb, const Feed& feed, double dloss) {
  if (c.first) c.slot_of[mb] = take_slot(c);
  const int s = c.slot_of.at(mb);
  Tensor tokens = c.own_tokens ? c.tokens[size_t(s)] : Tensor();
  if (c.own_tokens || c.own_targets) {
    // The feed fills the slot wherever it lives (a device slot through the loader's staging upload).
    StepClock::Scope part(clock_, StepPart::DataWait, {tl_, "data_wait", Track::Main, mb, c.g});
    feed(mb, tokens, c.own_targets ? c.targets[size_t(s)] : Tensor());
  }
  Tensor targets;  // the head's: in its own slot, or where the first chunk's forward put them (holds_targets)
  if (c.last && c.own_targets) targets = c.targets[size_t(s)];
  if (c.last && !c.own_targets) {
    const Chunk& f = chunks_[size_t(map_.local_of(0))];
    targets = f.targets[size_t(f.slot_of.at(mb))];
  }
  // A split backward's layer inputs stay in an input slot of their own until W.
  const MicrobatchSlots at = c.split ? MicrobatchSlots(s, input_slot(c, mb, true), 0) : MicrobatchSlots(s);
  timed_pass(c, ComputeSpans::Forward, "forward", mb, [&] { c.model->forward(ctx, at, tokens, targets, dloss); });
}

void PipelineExecutor::send_activation(Chunk& c, int mb) {
  if (c.next_local >= 0) return;  // the next chunk copies it from the slot (receive)
  const int s = c.slot_of.at(mb);
  const double t0 = now_seconds();
  c.slot_send[size_t(s)] = ch_.act_send->send_async(c.model->stage_output(s), c.next_rank, tag(0, mb, c.g + 1));
  note_transfer(c.slot_send[size_t(s)], "send_activation", Track::PipeSend, OpKind::PpSend, mb, c.g,
                c.model->stage_output(s), t0);
}

// A whole backward, or one of its two parts (zb_h1): the input-gradient
// part takes the received gradient and frees its buffer, and frees the
// activation slot as a whole backward does; what the weight part needs
// stays in the microbatch's input slot and the weight slot B takes, both
// freed by the weight part.
void PipelineExecutor::backward(const KernelContext& ctx, Chunk& c, int mb, BackwardPart part) {
  const bool weight_part = part == BackwardPart::WeightGrad;
  const int s = weight_part ? -1 : c.slot_of.at(mb);
  MicrobatchSlots at(s);
  if (c.split)
    at = MicrobatchSlots(s, input_slot(c, mb, false),
                         part == BackwardPart::Full ? 0 : weight_slot(c, mb, part == BackwardPart::InputGrad));
  Tensor out_grad;
  int gb = -1;
  if (!c.last && part != BackwardPart::WeightGrad) {
    gb = c.grad_of.at(mb);
    out_grad = c.grad_bufs[size_t(gb)];
  }
  // Backwards (and their parts) run in microbatch order per chunk, so the last one makes the gradients final.
  const GradPhase phase = mb == m_ - 1 ? GradPhase::Final : GradPhase::Accumulate;
  timed_pass(c, ComputeSpans::Backward, part == BackwardPart::WeightGrad ? "backward_weight" : "backward", mb, [&] {
    c.model->backward(ctx, at, c.first && !weight_part ? c.tokens[size_t(s)] : Tensor(), phase, out_grad, part);
  });
  if (gb >= 0) {
    c.grad_of.erase(mb);
    c.free_grad.push_back(gb);
  }
  if (!weight_part) {
    c.slot_of.erase(mb);
    c.free_slots.push_back(s);
  }
  if (c.split && part != BackwardPart::InputGrad) {
    c.input_of.erase(mb);
    c.free_inputs.push_back(at.input);
    if (weight_part) {
      c.weight_of.erase(mb);
      c.free_weights.push_back(at.weight);
    }
  }
}

void PipelineExecutor::send_gradient(const KernelContext& ctx, Chunk& c, int mb) {
  if (c.prev_local >= 0) {
    // The V's turn: into one of the previous chunk's received-gradient buffers, held until its backward.
    Chunk& to = chunks_[size_t(c.prev_local)];
    XR_CHECK(!to.free_grad.empty(), "pipeline: no free gradient buffer on model chunk ", to.g, " for microbatch ", mb);
    const int b = to.free_grad.back();
    to.free_grad.pop_back();
    to.grad_of[mb] = b;
    copy_tensor(to.grad_bufs[size_t(b)], c.model->input_grad(), ctx.cuda_stream, false);
    return;
  }
  const size_t b = size_t(c.next_send);
  c.next_send = (c.next_send + 1) % int(c.send_bufs.size());
  if (c.send_work[b]) join_send(c.send_work[b], c.g);
  // Copied on the compute stream; the send's input-ready wait orders it after the copy.
  copy_tensor(c.send_bufs[b], c.model->input_grad(), ctx.cuda_stream, false);
  const double t0 = now_seconds();
  c.send_work[b] = ch_.grad_send->send_async(c.send_bufs[b], c.prev_rank, tag(1, mb, c.g - 1));
  note_transfer(c.send_work[b], "send_gradient", Track::PipeSend, OpKind::PpSend, mb, c.g, c.send_bufs[b], t0);
}

// Every send must be delivered before its buffer is written again: on the
// host the step waits for them; on a device the compute stream does.
void PipelineExecutor::join_sends() {
  StepClock::Scope part(clock_, StepPart::PpCommExposed, {p_ > 1 ? tl_ : nullptr, "wait_send"});
  in_flight_.clear();
  for (Chunk& c : chunks_) {
    for (auto* list : {&c.slot_send, &c.send_work})
      for (auto& w : *list)
        if (w) {
          w->join(stream_);
          if (stream_) in_flight_.push_back(w);
          w.reset();
        }
  }
}

}  // namespace xirang
