#include "runtime/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/clock.h"
#include "core/device_memory.h"
#include "kernels/elementwise.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/model_layout.h"

namespace xirang {

namespace {

void record(TrainResult& r, const StepMetrics& m) {
  r.losses.push_back(m.loss);
  r.grad_norms.push_back(m.grad_norm);
  r.steps.push_back(m);
}

// Pipeline tags for evaluation, above any training tag in use.
constexpr int kEvalTag = 30000;

// Copies a host tensor's bytes into `dst`, which may live on a device.
void upload(Tensor dst, const void* host) {
  copy_bytes(dst.raw(), dst.device(), host, Device::CPU, dst.bytes(), nullptr, true);
}

}  // namespace

// ---------------------------------------------------------------------------
// The training loop

TrainResult Trainer::run() {
  TrainResult result;
  if (opts_.print) print_run();
  const int last = last_step();
  for (int step = int(start_step_); step < last; ++step) {
    faults_->at_step(step + 1);
    ckpt_->poll();
    StepMetrics m;
    m.step = step + 1;
    for (auto& o : observers_) o->on_step_begin(m.step);
    clock_.start();
    const RunQueueWait cpu_wait;
    const EnergySpan energy(energy_.get());  // the GPU's joules over the step (none on the CPU)
    zero_gradients();
    sync_->begin_step();
    accumulate_gradients(step);  // forward and backward of every microbatch, buckets reduced as they fill
    sync_->finish(ctx_.cuda_stream);
    wait_step_transfers();
    if (faults_->poisons_gradient(step + 1)) inject_nan_grad(step + 1);
    const double local_loss = optimizer_step(m, step);
    m.loss = global_loss(local_loss);
    if (ckpt_->due(m.step, last)) save_checkpoint(m);  // its stall is part of step_ms
    clock_.stop();
    take_parts(m);
    take_rates(m, clock_.step_ms());
    m.cpu_wait_ms = cpu_wait.ms();
    m.energy = energy.take(tokens_per_replica());
    // The span is the clock's own interval: what the step holds (a checkpoint
    // save) nests in it, however the thread is scheduled.
    add_span(ctx_.timeline, "step", Track::Main, clock_.started_at(), clock_.started_at() + m.step_ms / 1e3, -1, -1,
             m.step);
    if (eval_due(m.step)) evaluate_after(m, result);
    if (timeline_.profiling()) m.ops = timeline_.take_ops();
    for (auto& o : observers_) o->on_step(m);
    record(result, m);
    // A preemption signal on any rank (agreed in the step guard's vote): every rank stops after this same step.
    if (m.step < last && stop_request_) {
      result.preempted = save_for_stop(stop_request_, m);
      break;
    }
  }
  ckpt_->finish();  // before the observers finish: the trace window holds the writer's span
  for (auto& o : observers_) o->on_finish();
  if (result.preempted) report_stop(*result.preempted);
  return result;
}

// The gradient norm, the skip vote and the update: the optimizer's part of
// the step. Returns this rank's loss (summed over the job by global_loss).
double Trainer::optimizer_step(StepMetrics& m, int step) {
  StepClock::Scope optimizer(&clock_, StepPart::Optimizer, {ctx_.timeline, "optimizer"});
  const double scale = loss_scale_.scale();
  m.loss_scale = scale;
  // The step's one host wait (on a device): the norm decides clipping and skipping.
  m.grad_norm = sync_->grad_norm(ctx_, *opt_) / scale;
  const double local_loss = take_local_loss();
  device_times_ = {};
  if (device_ != Device::CPU) exec_->take_device_times(device_times_);
  m.lr = lr_at(cfg_.train, step);
  // One vote over the world: the skip (non-finite values, loss spikes) and a preemption signal on any rank.
  const StepGuard::Verdict v = guard_->vote(m.step, m.grad_norm, local_loss, stop_vote(opts_.stop, grid_->world_rank()));
  stop_request_ = stop_of(v.extra);
  m.skipped = v.skip;
  if (!m.skipped) update_parameters(m.lr, m.grad_norm, scale);
  return local_loss;
}

// Evaluation is no step's: its time is outside step_ms and its ops stay out of the step's profile.
void Trainer::evaluate_after(StepMetrics& m, TrainResult& result) {
  SpanScope span(ctx_.timeline, "eval", Track::Main, -1, -1, m.step);
  timeline_.set_profiling(false);
  result.final_val_loss = m.val_loss = evaluate();
  timeline_.set_profiling(cfg_.metrics.op_profile);
}

Preemption Trainer::save_for_stop(const StopRequest& stop, const StepMetrics& m) {
  Preemption p{stop.signal, stop.rank, m.step, ""};
  if (cfg_.checkpoint.dir.empty()) return p;
  // This step's own save (checkpoint.every) may still be writing: finish() waits for it.
  if (!m.checkpoint_saved) ckpt_->save(m.step, ctx_.cuda_stream, ctx_.timeline);
  ckpt_->finish();
  p.checkpoint = CheckpointDir(cfg_.checkpoint.dir).step_dir(m.step);
  return p;
}

void Trainer::report_stop(const Preemption& p) const {
  if (is_logger()) {
    const std::string saved = p.checkpoint.empty()
                                  ? std::string("checkpoint.dir is not set, so nothing was saved")
                                  : str_cat("saved ", p.checkpoint, " (checkpoint.resume=auto continues from it)");
    std::fprintf(stderr, "preempted: %s received by rank %d; stopped after step %d of %d; %s; exit status %d\n",
                 signal_name(p.signal).c_str(), p.rank, p.step, cfg_.train.steps, saved.c_str(), kPreemptedExitCode);
    std::fflush(stderr);
  }
  // No rank exits before the line is out (mpirun ends the job when the first rank exits non-zero).
  grid_->world().barrier();
}


// train.stop_after ends this run early; the schedule still spans train.steps.
int Trainer::last_step() const {
  return cfg_.train.stop_after > 0 ? std::min(cfg_.train.stop_after, cfg_.train.steps) : cfg_.train.steps;
}

// The gradient arena holds only gradients (padding included): one fill for all of them.
void Trainer::zero_gradients() {
  const DType gd = chunks_.front()->grad_dtype();
  zero(ctx_, Tensor(grads_.base(), {int64_t(grads_.used() / dtype_size(gd))}, gd, device_));
}

void Trainer::reduce_tied(Parameter& p) {
  // On a device the compute stream waits for the sum; the host goes on (and
  // waits with the timeout at the end of the step).
  StepClock::Scope part(&clock_, StepPart::PpCommExposed, {ctx_.timeline, "tied_all_reduce"});
  WorkPtr w = comm_->embedding().all_reduce_async(p.grad, ReduceOp::Sum);
  w->join(ctx_.cuda_stream);
  if (ctx_.timeline) ctx_.timeline->add_op_later(OpKind::TiedAllReduce, [w] { return w->duration_ms(); });
  tied_work_.push_back(std::move(w));
}

void Trainer::sum_tied_locally(Parameter& original, Parameter& copy) {
  // Inside the first chunk's backward pass (its gradient-ready hook): timed as part of it.
  add(ctx_, original.grad, original.grad, copy.grad);
  copy_tensor(copy.grad, original.grad, ctx_.cuda_stream, false);
}

void Trainer::accumulate_gradients(int step) {
  const int micro = cfg_.microbatches();
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  // d(mean loss of the global batch) / d(per-token loss): every microbatch has B*T tokens.
  // Under fp16 it is scaled up so that small gradients survive 16-bit storage.
  // With context parallelism T stays the whole sequence: a cp rank seeds
  // only its own B*T/cp tokens' losses, each with this same weight 1/(GB*T),
  // and its parameter gradients hold those tokens' terms (the key/value
  // gradients of other ranks' tokens come back to it in attention's
  // backward). Every token of the global batch lives on exactly one
  // dp x cp rank, so the SUM over dp x cp (GradSync's buckets) is the
  // gradient of the global mean: no further 1/cp.
  const double dloss = loss_scale_.scale() / (double(B) * T * micro * cfg_.parallel.dp);
  const auto feed = [&](int mb, const Tensor& tk, const Tensor& tg) { loader_->next(step, mb, tk, tg, ctx_.cuda_stream); };
  delay_if_slow(step);
  exec_->run(ctx_, schedule_, feed, dloss);
  drain_pipeline();
}

// faults.kind=slow_rank: a slow device, seen as a longer first forward. Before
// the schedule, so that the neighbours wait for it where they would wait for
// a slow stage (a receive, the gradient reduction), not inside their own
// compute (a tied gradient's reduction runs inside the first stage's backward).
void Trainer::delay_if_slow(int step) {
  StepClock::Scope part(&clock_, StepPart::Forward,
                        {cfg_.faults.kind == FaultKind::SlowRank ? ctx_.timeline : nullptr, "fault_delay"});
  faults_->delay_compute(step + 1);
}

// A tied copy (the last stage's token table) is final once its head passes
// are done. Its reduction waits for the original's chunk to finish, and so
// does the barrier after it on every stage: a stage that finished its list
// early idles here until the pipeline has drained, which is bubble too (the
// reductions and bucket launches in it are their own parts).
void Trainer::drain_pipeline() {
  const bool pipelined = cfg_.parallel.pp > 1;
  StepClock::Scope drain(pipelined ? &clock_ : nullptr, StepPart::PpBubble,
                         {pipelined ? ctx_.timeline : nullptr, "pipeline_drain"});
  for (Parameter* t : tied_copies_) {
    reduce_tied(*t);
    sync_->layer_done(t->layer);
  }
  // (On a device the host has only queued the work: no barrier, the streams order it.)
  if (pipelined && device_ == Device::CPU) grid_->pp().barrier();
}

void Trainer::wait_step_transfers() {
  if (device_ != Device::CPU) {
    // A dead peer fails here, with the channel's timeout, rather than stalling the stream.
    exec_->wait_sends();
    for (auto& w : tied_work_) w->wait();
  }
  tied_work_.clear();
}

// The forwards are done by now, so reading the loss costs no further wait.
double Trainer::take_local_loss() {
  double local_loss = 0;
  for (auto& c : chunks_) local_loss += c->take_loss(ctx_);
  return local_loss / cfg_.microbatches();
}

void Trainer::take_parts(StepMetrics& m) const {
  m.forward_ms = clock_.ms(StepPart::Forward);
  m.backward_ms = clock_.ms(StepPart::Backward);
  m.optimizer_ms = clock_.ms(StepPart::Optimizer);
  m.data_wait_ms = clock_.ms(StepPart::DataWait);
  m.data_prefetch_depth = loader_ ? loader_->depth() : 0;
  m.tp_comm_ms = clock_.ms(StepPart::TpComm);
  m.cp_comm_ms = clock_.ms(StepPart::CpComm);
  m.dp_comm_ms = sync_->comm_ms();
  m.dp_comm_exposed_ms = clock_.ms(StepPart::DpCommExposed);
  m.pp_bubble_ms = clock_.ms(StepPart::PpBubble);
  m.pp_comm_exposed_ms = clock_.ms(StepPart::PpCommExposed);
  m.ckpt_stall_ms = clock_.ms(StepPart::CkptStall);
  m.unaccounted_ms = clock_.unaccounted_ms();
  if (device_ == Device::CPU) return;
  // On a device the host only queued the passes (its time in them, and its
  // wait for the stream, are the clock's): their times are the stream's.
  m.forward_ms = device_times_.forward_ms + faults_->compute_delay_ms(m.step);  // the host's slow_rank sleep
  m.backward_ms = device_times_.backward_ms;
  m.tp_comm_ms = device_times_.tp_comm_ms;
  m.pp_bubble_ms += device_times_.bubble_ms;
  m.dp_comm_exposed_ms = sync_->device_exposed_ms();
}

void Trainer::inject_nan_grad(int step) {
  const bool tp_split = cfg_.parallel.tp > 1;
  for (const auto& seg : opt_->segments())
    if (!seg.tied_copy && seg.grad.numel() > 0 && !(tp_split && seg.tp_replicated && grid_->coords().tp != 0)) {
      faults_->poison_gradient(step, seg.grad, params_[size_t(seg.param_index)].name, ctx_.cuda_stream);
      return;
    }
}

void Trainer::update_parameters(double lr, double grad_norm, double scale) {
  opt_->step(ctx_, lr, clip_scale(cfg_.train.grad_clip, grad_norm) / scale);
  sync_->gather_parameters();
  // State that follows the step (a mixture of experts' selection bias, from
  // this rank's loads: summing them over dp is expert parallelism's step).
  for (auto& c : chunks_) c->end_step(ctx_);
}

// The loss lives on the last stage; the global batch's is the mean over
// dp x cp of equal-sized parts (a cp rank's loss is the mean over its own
// T/cp rows of each sequence, and every rank holds as many).
double Trainer::global_loss(double local_loss) {
  SpanScope span(ctx_.timeline, "loss_all_reduce");
  const double stage_loss = grid_->pp().all_reduce_sum(local_loss);
  return grid_->dp_cp().all_reduce_sum(stage_loss) / (double(cfg_.parallel.dp) * cfg_.parallel.cp);
}

void Trainer::save_checkpoint(StepMetrics& m) {
  StepClock::Scope part(&clock_, StepPart::CkptStall, {ctx_.timeline, "checkpoint_save", Track::Main, -1, -1, m.step});
  ckpt_->save(m.step, ctx_.cuda_stream, ctx_.timeline);
  m.checkpoint_saved = true;
}

void Trainer::take_rates(StepMetrics& m, double step_ms) const {
  // MFU per rank: this rank's share of the step's FLOPs against one rank's peak.
  const double flops_per_rank = chunks_.front()->flops_per_token() * tokens_per_step() / grid_->shape().world();
  m.step_ms = step_ms;
  m.tokens_per_s = tokens_per_step() / (m.step_ms / 1e3);
  m.mfu = flops_per_rank / (m.step_ms / 1e3) / peak_.flops;
}

bool Trainer::eval_due(int step) const {
  const int every = cfg_.train.eval_every;
  return every > 0 && (step % every == 0 || step == cfg_.train.steps) && val_sampler_;
}

double Trainer::evaluate() {
  XR_CHECK(val_sampler_, "evaluate() without data.val");
  const int B = cfg_.train.micro_batch;
  const int dp = cfg_.parallel.dp, dp_rank = grid_->coords().dp;
  const int rank = grid_->coords().pp;
  const ChunkMap map = chunk_map(cfg_.parallel);
  const PipeChannels& pipe = comm_->pipe();
  const int64_t n = std::min<int64_t>(cfg_.train.eval_batches, std::max<int64_t>(1, val_sampler_->samples_per_epoch() / B));
  // This cp rank's rows of each sample (all T when cp = 1); the cp ranks of a dp rank read the same samples.
  const SampleRows rows = sample_rows();
  const int64_t T = rows.rows(cfg_.seq_len());
  io_.reset();
  Tensor tokens = io_.alloc({B, T}, DType::I32, "eval tokens"), targets = io_.alloc({B, T}, DType::I32, "eval targets");
  std::vector<int32_t> host_tokens(size_t(B * T)), host_targets(size_t(B * T));
  double sum = 0;
  for (int64_t mb = dp_rank; mb < n; mb += dp) {
    if (chunks_.front()->placement().has_embedding || chunks_.back()->placement().has_head) {
      for (int b = 0; b < B; ++b)
        val_sampler_->fill(mb * B + b, rows, host_tokens.data() + int64_t(b) * T, host_targets.data() + int64_t(b) * T);
      upload(tokens, host_tokens.data());
      upload(targets, host_targets.data());
    }
    // Forward only, through the chunks in model order; each stage waits for its input
    // (at the V's turn the previous chunk is this rank's: a copy).
    for (int c = 0; c < int(chunks_.size()); ++c) {
      ModelChunk& g = *chunks_[size_t(c)];
      const int at = map.model_chunk(rank, c);
      // On the activation channel: the order (and, on NCCL, the device tensors) of training's transfers.
      if (at > 0 && map.rank_of(at - 1) == rank)
        copy_tensor(g.stage_input(0), chunks_[size_t(map.local_of(at - 1))]->stage_output(0), ctx_.cuda_stream, false);
      else if (at > 0)
        pipe.act_recv->recv(g.stage_input(0), map.rank_of(at - 1), kEvalTag);
      g.forward(ctx_, 0, tokens, targets, 0.0);
      if (at + 1 < map.chunks() && map.rank_of(at + 1) != rank)
        pipe.act_send->send(g.stage_output(0), map.rank_of(at + 1), kEvalTag);
    }
  }
  for (auto& c : chunks_) {
    sum += c->take_loss(ctx_);
    c->take_tp_comm();  // evaluation runs outside step_ms: its tensor-parallel time is no step's
  }
  sum = grid_->pp().all_reduce_sum(sum);  // only the last stage has losses
  // Each of a microbatch's cp ranks holds the mean over its own T/cp rows: their mean is the microbatch's.
  return grid_->dp_cp().all_reduce_sum(sum) / (double(n) * cfg_.parallel.cp);
}

}  // namespace xirang
