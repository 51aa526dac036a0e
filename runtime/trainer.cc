#include "runtime/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/clock.h"
#include "core/device_memory.h"
#include "kernels/elementwise.h"
#include "runtime/baseline.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/model_layout.h"
#include "runtime/memory_estimate.h"
#include "runtime/prometheus_exporter.h"
#include "runtime/straggler.h"

namespace xirang {

namespace {

std::string count_str(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.1fK", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

// data.verify: every shard's checksum, before any step reads it. A large
// split (over 1 GB) reports its progress every 10 s on world rank 0.
void verify_split(const TokenDataset& ds, const char* key, bool print) {
  Stopwatch sw;
  double last_report = 0;
  int64_t bytes = 0;
  ds.verify_checksums([&](int64_t done, int64_t total) {
    bytes = total;
    if (print && total > (int64_t(1) << 30) && sw.seconds() - last_report >= 10) {
      last_report = sw.seconds();
      std::fprintf(stderr, "%s: verifying shard checksums: %.1f of %.1f GB (data.verify=false skips this)\n", key,
                   done / 1e9, total / 1e9);
    }
  });
  if (print && bytes > (int64_t(1) << 30))
    std::fprintf(stderr, "%s: %zu shards (%.1f GB) verified in %.1f s\n", key, ds.index().shards.size(), bytes / 1e9,
                 sw.seconds());
}

TokenDataset open_split(const std::string& dir, const char* key, const Config& cfg, bool print) {
  TokenDataset ds = TokenDataset::open(dir);
  if (cfg.data.verify) verify_split(ds, key, print);
  if (ds.index().vocab_size > cfg.model.vocab_size)
    fail(ErrorKind::Config, key, ": dataset vocabulary ", ds.index().vocab_size, " is larger than model.vocab_size ",
         cfg.model.vocab_size);
  return ds;
}

// The model's dtype: F64 when the caller asks for exactness runs, else precision.dtype.
DType model_dtype_of(const Config& c, DType requested) {
  if (requested == DType::F64) return DType::F64;
  switch (c.precision.dtype) {
    case Precision::BF16: return DType::BF16;
    case Precision::FP16: return DType::F16;
    case Precision::FP32: break;
  }
  return DType::F32;
}

LossScale loss_scale_of(const PrecisionConfig& pc, DType model_dtype) {
  if (pc.loss_scale > 0) return LossScale(pc.loss_scale, false, pc.growth_interval);
  if (model_dtype == DType::F16)
    return LossScale(pc.initial_scale, true, pc.growth_interval, pc.min_scale, pc.hysteresis);
  return LossScale();
}

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
// Construction

Trainer::Trainer(const Config& cfg, TrainerOptions opts, ProcessGrid* grid) : cfg_(cfg), opts_(opts), grid_(grid) {
  if (!grid_) {
    own_grid_ = ProcessGrid::single();
    grid_ = own_grid_.get();
  }
  const GridShape& gs = grid_->shape();
  if (gs.dp != cfg_.parallel.dp || gs.tp != cfg_.parallel.tp || gs.pp != cfg_.parallel.pp)
    fail(ErrorKind::Config, "the process grid (dp ", gs.dp, ", tp ", gs.tp, ", pp ", gs.pp,
         ") does not match parallel.dp=", cfg_.parallel.dp, ", tp=", cfg_.parallel.tp, ", pp=", cfg_.parallel.pp);
  opts_.print = opts_.print && is_logger();
  model_dtype_ = model_dtype_of(cfg_, opts_.dtype);
  comm_ = std::make_unique<CommGroups>(cfg_, *grid_, model_dtype_);
  device_ = comm_->device();
  ctx_ = comm_->kernel_context();
  if (cfg_.metrics.op_profile || !cfg_.metrics.trace.empty()) ctx_.timeline = &timeline_;
  timeline_.set_profiling(cfg_.metrics.op_profile);
  trace_ = std::make_unique<TraceWindow>(cfg_.metrics, *grid_);
  faults_ = std::make_unique<FaultInjector>(cfg_.faults, *grid_, device_);
  loss_scale_ = loss_scale_of(cfg_.precision, model_dtype_);
  build_schedule();
  open_data();
  build_chunks();
  std::vector<ModelChunk*> raw;
  for (auto& c : chunks_) raw.push_back(c.get());
  exec_ = std::make_unique<PipelineExecutor>(raw, comm_->pipe(), cfg_.parallel.pp, grid_->coords().pp,
                                             cfg_.parallel.virtual_stages, cfg_.microbatches());
  build_arenas();
  start_step_ = ckpt_->resume(model_dtype_);
  build_loader();
  choose_peak();
  build_observers();
}

Trainer::~Trainer() = default;

void Trainer::build_schedule() {
  const int p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages, m = cfg_.microbatches();
  if (p == 1 && v > 1)
    fail(ErrorKind::Config, "parallel.virtual_stages=", v, " needs parallel.pp > 1 (virtual stages interleave ranks)");
  schedule_kind_ = parse_schedule(cfg_.parallel.schedule, "parallel.schedule");
  schedule_ = make_schedule(schedule_kind_, p, grid_->coords().pp, m, v);
}

// The data come first: a missing or corrupt dataset should fail before any large allocation.
void Trainer::open_data() {
  train_data_.emplace(open_split(cfg_.data.train, "data.train", cfg_, is_logger()));
  if (!cfg_.data.val.empty()) {
    val_data_.emplace(open_split(cfg_.data.val, "data.val", cfg_, is_logger()));
    val_sampler_ = std::make_unique<SequenceSampler>(*val_data_, cfg_.seq_len(), cfg_.train.seed, false);
  }
}

void Trainer::build_chunks() {
  const ModelDims dims = model_dims(cfg_.model);
  const ModelArch& arch = model_arch(dims.arch);
  const int p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages, rank = grid_->coords().pp;
  // Slots: the most microbatches the schedule keeps alive per chunk, plus
  // the receives the executor posts ahead.
  const int slots = max_in_flight(schedule_, v) + (p > 1 ? 2 : 0);
  chunks_.clear();
  for (int c = 0; c < v; ++c) {
    const int g = model_chunk(p, rank, c);
    chunks_.push_back(arch.make_chunk(dims, ChunkPlacement::of_chunk(dims.n_layer, p * v, g), model_dtype_,
                                      chunk_batch(cfg_, slots),
                                      TensorParallel{&comm_->tp(), cfg_.parallel.sequence_parallel}));
  }
}

void Trainer::build_arenas() {
  // Size every arena by running the carving code against measuring arenas.
  Arena mp = Arena::measuring("parameters"), mg = Arena::measuring("gradients");
  Arena ms = Arena::measuring("optimizer state"), mz = Arena::measuring("gradient shard");
  Arena ma = Arena::measuring("activations");
  for (auto& c : chunks_) c->layout_parameters(mp, mg);
  for (auto& c : chunks_) c->layout_activations(ma);
  exec_->layout(ma);
  // GradSync needs real parameter addresses for its offsets, so the
  // parameter and gradient arenas are created before the rest is measured:
  // a plan over the limit already without the rest is refused before that.
  MemoryPlan early;
  early.add("parameters", mp.used());
  early.add("gradients", mg.used());
  early.add("activations", ma.used());
  early.check_limit(size_t(cfg_.memory.limit_gb * double(1ull << 30)), "memory.limit_gb");
  params_arena_ = Arena("parameters", mp.used(), device_);
  grads_ = Arena("gradients", mg.used(), device_);
  for (auto& c : chunks_) c->layout_parameters(params_arena_, grads_);
  collect_parameters();
  build_optimizer(mz, ms);
  const ChunkBatch& batch = chunks_.front()->batch();
  const size_t io_bytes = 2 * size_t(batch.micro_batch) * batch.seq_len * 4 + 2 * Arena::kAlignment;
  const ArenaSizes sizes{mp.used(), mg.used(), ms.used(), mz.used(), ma.used(), io_bytes};
  plan_memory(sizes);
  allocate_arenas(sizes);
  init_parameters();
}

void Trainer::collect_parameters() {
  params_.clear();
  for (auto& c : chunks_)
    for (auto& prm : c->parameters()) params_.push_back(prm);
  tied_.clear();
  tied_copies_.clear();
  for (auto& c : chunks_)
    for (Parameter* prm : c->tied_parameters()) (prm->tied_copy ? tied_copies_ : tied_).push_back(prm);
}

// Gradient sync, AdamW over its segments, and the checkpointer of both.
void Trainer::build_optimizer(Arena& measure_shard, Arena& measure_state) {
  sync_ = std::make_unique<GradSync>(
      params_, comm_->dp_grads(), &grid_->tp(), &grid_->pp(),
      GradSyncOptions{cfg_.parallel.bucket_mb, cfg_.parallel.overlap_grad_reduce, cfg_.parallel.zero == 1},
      &grid_->dp());
  opt_ = std::make_unique<AdamW>(cfg_.train);
  sync_->set_timeline(ctx_.timeline);
  sync_->layout(measure_shard);
  opt_->set_segments(sync_->optimizer_segments());
  opt_->layout_state(measure_state);
  ckpt_ = std::make_unique<Checkpointer>(cfg_, *grid_, TrainingState{params_, *opt_, loss_scale_}, device_, *faults_,
                                         opts_.print);
}

void Trainer::plan_memory(const ArenaSizes& sizes) {
  const int dp = cfg_.parallel.dp, p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages;
  const bool zero = cfg_.parallel.zero == 1;
  int64_t local_params = 0;
  for (auto& c : chunks_) local_params += c->num_parameters();
  const std::string per = count_str(double(local_params)) + " x " + dtype_name(model_dtype_);
  const std::string per_wide = count_str(double(local_params)) + " x " + dtype_name(chunks_.front()->grad_dtype());
  plan_.add("parameters", sizes.params, per);
  plan_.add("gradients", sizes.grads, per_wide);
  const char* state_what = opt_->has_master() ? "AdamW m and v and fp32 master weights" : "AdamW m and v";
  plan_.add("optimizer state", sizes.opt_state,
            zero ? str_cat(state_what, " of a 1/", dp, " shard (ZeRO-1)") : str_cat(state_what, ", ", per_wide, " each"));
  if (zero) plan_.add("gradient shard", sizes.shard, str_cat("reduce-scattered gradients, 1/", dp));
  const ChunkBatch& batch = chunks_.front()->batch();
  plan_.add("activations", sizes.acts,
            str_cat("micro_batch ", batch.micro_batch, " x seq_len ", batch.seq_len, " x ", batch.activation_slots,
                    " slot(s) x ", v, " chunk(s) of ", cfg_.model.n_layer / (p * v), " layer(s)",
                    cfg_.parallel.tp > 1 ? str_cat(", split over tp=", cfg_.parallel.tp) : "",
                    cfg_.parallel.sequence_parallel ? " with sequence parallelism" : ""));
  plan_.add("input batch", sizes.io, "evaluation tokens and targets, int32");
  if (opts_.print) {
    std::fprintf(stderr, "%s",
                 plan_.table(str_cat("memory plan (per rank; dp=", dp, ", tp=", cfg_.parallel.tp, ", pp=", p,
                                     p > 1 ? str_cat(" ", schedule_name(schedule_kind_)) : "", "):"))
                     .c_str());
    std::fprintf(stderr, "%s\n", recompute_line().c_str());
  }
  if (ckpt_->uses_snapshot())
    plan_.add("checkpoint snapshot", sizes.params + sizes.opt_state, "parameters and AdamW state, in host memory");
  plan_.check_limit(size_t(cfg_.memory.limit_gb * double(1ull << 30)), "memory.limit_gb");
}

// The activations one microbatch keeps on this rank under each
// train.recompute mode, from the same layout-only accounting
// (runtime/memory_estimate.h): "activations per microbatch: none 1.2 GiB,
// selective ..., full ... (train.recompute=full)".
std::string Trainer::recompute_line() const {
  const GridCoords at = grid_->coords();
  std::string line = "activations per microbatch:";
  for (RecomputeMode m : {RecomputeMode::None, RecomputeMode::Selective, RecomputeMode::Full}) {
    Config c = cfg_;
    c.train.recompute = m;
    const ActivationSplit split = activation_split(c, {at.pp, at.tp, at.dp});
    line += str_cat(m == RecomputeMode::None ? " " : ", ", recompute_name(recompute_mode(c.train)), " ",
                    format_bytes(split.per_slot));
  }
  return line + str_cat(" (train.recompute=", recompute_name(recompute_mode(cfg_.train)), ")");
}

void Trainer::allocate_arenas(const ArenaSizes& sizes) {
  opt_state_ = Arena("optimizer state", sizes.opt_state, device_);
  if (ckpt_->uses_snapshot()) ckpt_->allocate_snapshot(sizes.params + sizes.opt_state);
  shard_ = Arena("gradient shard", sizes.shard, device_);
  acts_ = Arena("activations", sizes.acts, device_);
  io_ = Arena("input batch", sizes.io, device_);
  sync_->layout(shard_);
  opt_->set_segments(sync_->optimizer_segments());
  opt_->layout_state(opt_state_);
  for (auto& c : chunks_) c->layout_activations(acts_);
  exec_->layout(acts_);
}

// Every rank initialises its part of the model from the same seed: replicas
// start identical, and shards equal slices of the one-rank model, without communication.
void Trainer::init_parameters() {
  for (auto& c : chunks_) {
    c->init_parameters(cfg_.train.seed);
    c->set_grad_ready_hook([this](int l) {
      // A tied original's gradient is final here: add its copies' contributions first.
      for (Parameter* t : tied_)
        if (t->layer == l) reduce_tied(*t);
      launch_buckets(l);
    });
  }
  opt_->init_master(ctx_);
}

void Trainer::build_loader() {
  // Only the ranks that need input read it: the first stage the tokens, the last the targets.
  const bool need_tokens = chunks_.front()->placement().has_embedding;
  const bool need_targets = chunks_.back()->placement().has_head;
  if (!need_tokens && !need_targets) return;
  LoaderSpec spec;
  spec.seq_len = cfg_.seq_len();
  spec.seed = cfg_.train.seed;
  spec.micro_batch = cfg_.train.micro_batch;
  spec.global_batch = cfg_.train.global_batch;
  spec.dp = cfg_.parallel.dp;
  spec.dp_rank = grid_->coords().dp;
  spec.microbatches = cfg_.microbatches();
  spec.need_tokens = need_tokens;
  spec.need_targets = need_targets;
  spec.first_step = start_step_;
  // Microbatches go straight into the device's activation slots, one staging buffer per slot.
  spec.device = device_;
  spec.staging_buffers = chunks_.front()->batch().activation_slots;
  LoaderOptions lo;
  lo.enabled = cfg_.data.prefetch;
  lo.prefetch_min = cfg_.data.prefetch_min;
  lo.prefetch_max = cfg_.data.prefetch_max;
  lo.threads = cfg_.data.loader_threads;
  lo.read_delay_ms = cfg_.data.read_delay_ms;
  loader_ = std::make_unique<PrefetchLoader>(*train_data_, spec, lo);
}

// The metrics' exporters and monitors (runtime/step_observer.h), in the
// order they see each step.
void Trainer::build_observers() {
  observers_.clear();
  // The monitors fill the step's metrics before the exporter publishes them.
  if (cfg_.metrics.straggler_every > 0) observers_.push_back(std::make_unique<StragglerDetector>(cfg_.metrics, *grid_));
  if (!cfg_.metrics.baseline.empty()) observers_.push_back(std::make_unique<BaselineMonitor>(cfg_.metrics, is_logger()));
  add_prometheus_exporter(observers_, cfg_.metrics, grid_->world_rank(), {tokens_per_step(), double(plan_.total())});
}

void Trainer::choose_peak() {
  if (opts_.peak) peak_ = *opts_.peak;
  else if (cfg_.metrics.peak_tflops > 0) peak_ = {cfg_.metrics.peak_tflops * 1e12, "config metrics.peak_tflops"};
  else if (device_ != Device::CPU)
    // Dense tensor-core peak of an H100/H200 SXM (bf16/fp16; fp32 without TF32); other GPUs set metrics.peak_tflops.
    peak_ = {model_dtype_ == DType::F32 ? 66.9e12 : 989.4e12, "H100/H200 SXM datasheet (metrics.peak_tflops overrides)"};
  else peak_ = {measure_sgemm_flops(), "measured sgemm"};
}

// ---------------------------------------------------------------------------
// The training loop

TrainResult Trainer::run() {
  TrainResult result;
  MetricsLog log(is_logger() ? cfg_.metrics.jsonl : std::string(), peak_,
                 JsonlFields{cfg_.metrics.straggler_every > 0, !cfg_.metrics.baseline.empty(), cfg_.metrics.op_profile});
  log.set_planned_bytes(plan_.total());
  ProgressLine progress(cfg_.train.steps, cfg_.metrics.log_every);
  if (opts_.print) print_run();
  Stopwatch elapsed;
  const int last = last_step();
  for (int step = int(start_step_); step < last; ++step) {
    faults_->at_step(step + 1);
    ckpt_->poll();
    StepMetrics m;
    m.step = step + 1;
    trace_->before_step(m.step, timeline_);
    const double step_start = now_seconds();
    Stopwatch sw;
    const RunQueueWait cpu_wait;
    zero_gradients();
    sync_->begin_step();
    accumulate_gradients(step, m);  // forward and backward of every microbatch, buckets reduced as they fill
    sync_->finish(ctx_.cuda_stream);
    wait_step_transfers();
    if (faults_->poisons_gradient(step + 1)) inject_nan_grad(step + 1);
    // The optimizer's part leaves out the host's waits for data-parallel
    // communication (ZeRO's parameter gather; on a device the buckets'
    // host wait in grad_norm): on the CPU they are dp_comm_exposed_ms (on a
    // device that is the compute stream's wait, from timing events).
    const double dp_waits = sync_->host_held_ms();
    Stopwatch ow;
    SpanScope optimizer_span(ctx_.timeline, "optimizer");
    const double scale = loss_scale_.scale();
    m.loss_scale = scale;
    // The step's one host wait (on a device): the norm decides clipping and skipping.
    m.grad_norm = sync_->grad_norm(ctx_, *opt_) / scale;
    const double local_loss = take_local_loss();
    take_device_times(m);
    m.lr = lr_at(cfg_.train, step);
    m.skipped = skip_step(m.step, m.grad_norm, local_loss);
    if (!m.skipped) update_parameters(m.lr, m.grad_norm, scale);
    m.optimizer_ms = ow.ms() - (sync_->host_held_ms() - dp_waits);
    optimizer_span.end();
    m.loss = global_loss(local_loss);
    take_comm_times(m);
    if (ckpt_->due(m.step, last)) save_checkpoint(m);  // its stall is part of step_ms
    take_rates(m, sw.ms());
    m.cpu_wait_ms = cpu_wait.ms();
    add_span(ctx_.timeline, "step", Track::Main, step_start, step_start + m.step_ms / 1e3, -1, -1, m.step);
    if (eval_due(m.step)) {
      // Evaluation is no step's: its ops stay out of the step's profile.
      SpanScope span(ctx_.timeline, "eval", Track::Main, -1, -1, m.step);
      timeline_.set_profiling(false);
      result.final_val_loss = m.val_loss = evaluate();
      timeline_.set_profiling(cfg_.metrics.op_profile);
    }
    if (timeline_.profiling()) m.ops = timeline_.take_ops();
    for (auto& o : observers_) o->on_step(m);
    record(result, m);
    log.write(m);
    if (opts_.print) progress.update(m, elapsed.seconds());
    trace_->after_step(m.step, timeline_);
    // A preemption signal on any rank: every rank stops after this same step.
    if (m.step < last)
      if (const StopRequest stop = agree_on_stop(opts_.stop, grid_->world(), grid_->world_rank())) {
        result.preempted = save_for_stop(stop, m);
        break;
      }
  }
  ckpt_->finish();
  trace_->finish(timeline_);  // after the checkpoint writer: its span is in the window
  for (auto& o : observers_) o->on_finish();
  if (opts_.print) progress.finish();
  if (result.preempted) report_stop(*result.preempted);
  return result;
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

void Trainer::print_run() const {
  int64_t total = 0;
  for (auto& c : chunks_) total += c->num_global_parameters();
  std::fprintf(stderr,
               "model: %d layers, d_model %d, %d heads (%s parameters on this stage); layout dp %d x tp %d x pp %d%s%s; "
               "%d steps of %.0f tokens; peak %.1f GFLOP/s per rank (%s)\n",
               cfg_.model.n_layer, cfg_.model.d_model, cfg_.model.n_head, count_str(double(total)).c_str(),
               cfg_.parallel.dp, cfg_.parallel.tp, cfg_.parallel.pp, cfg_.parallel.zero ? " (ZeRO-1)" : "",
               cfg_.parallel.pp > 1 ? str_cat(" ", schedule_name(schedule_kind_)).c_str() : "", cfg_.train.steps,
               tokens_per_step(), peak_.flops / 1e9, peak_.source.c_str());
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
  Stopwatch sw;
  SpanScope span(ctx_.timeline, "tied_all_reduce");
  WorkPtr w = comm_->embedding().all_reduce_async(p.grad, ReduceOp::Sum);
  w->join(ctx_.cuda_stream);
  if (ctx_.timeline) ctx_.timeline->add_op_later(OpKind::TiedAllReduce, [w] { return w->duration_ms(); });
  tied_work_.push_back(std::move(w));
  own_comm_.tied_ms += sw.ms();
}

void Trainer::launch_buckets(int layer) {
  Stopwatch sw;
  sync_->layer_done(layer);
  own_comm_.launch_ms += sw.ms();
}

void Trainer::accumulate_gradients(int step, StepMetrics& m) {
  const int micro = cfg_.microbatches();
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  // d(mean loss of the global batch) / d(per-token loss): every microbatch has B*T tokens.
  // Under fp16 it is scaled up so that small gradients survive 16-bit storage.
  const double dloss = loss_scale_.scale() / (double(B) * T * micro * cfg_.parallel.dp);
  PipelineStats st;
  const auto feed = [&](int mb, const Tensor& tk, const Tensor& tg) { loader_->next(step, mb, tk, tg, ctx_.cuda_stream); };
  // faults.kind=slow_rank: a slow device, seen as a longer first forward. Before
  // the schedule, so that the neighbours wait for it where they would wait for
  // a slow stage (a receive, the gradient reduction), not inside their own
  // compute (a tied gradient's reduction runs inside the first stage's backward).
  {
    SpanScope span(cfg_.faults.kind == FaultKind::SlowRank ? ctx_.timeline : nullptr, "fault_delay");
    st.forward_ms += faults_->delay_compute(step + 1);
  }
  own_comm_ = {};
  exec_->run(ctx_, schedule_, feed, dloss, st);
  const StepCommTimes in_passes = own_comm_;
  // A tied copy (the last stage's token table) is final once its head
  // passes are done. Its reduction waits for the original's chunk to
  // finish, and so does the barrier after it on every stage: a stage that
  // finished its list early idles here until the pipeline has drained,
  // which is bubble too.
  Stopwatch drain;
  SpanScope drain_span(cfg_.parallel.pp > 1 ? ctx_.timeline : nullptr, "pipeline_drain");
  for (Parameter* t : tied_copies_) {
    reduce_tied(*t);
    launch_buckets(t->layer);
  }
  // (On a device the host has only queued the work: no barrier, the streams order it.)
  if (cfg_.parallel.pp > 1 && device_ == Device::CPU) grid_->pp().barrier();
  drain_span.end();
  const double drain_comm_ms = (own_comm_.tied_ms - in_passes.tied_ms) + (own_comm_.launch_ms - in_passes.launch_ms);
  // Each part once. The gradient-ready hook ran inside the backward passes:
  // its waits for the tied reduction are pipeline communication (the
  // embedding group joins the first and last stage), its bucket launches
  // data-parallel communication (GradSync's exposed time). On a device
  // take_device_times replaces the passes' times with the device's.
  m.forward_ms = st.forward_ms;
  m.backward_ms = st.backward_ms - in_passes.tied_ms - in_passes.launch_ms;
  m.tp_comm_ms = st.tp_comm_ms;
  // Getting the input: blocked on the loader, and copying (on a device, queuing the upload of) each microbatch.
  m.data_wait_ms = st.data_ms;
  m.data_prefetch_depth = loader_ ? loader_->depth() : 0;
  m.pp_bubble_ms = st.bubble_ms + drain.ms() - drain_comm_ms;
  m.pp_comm_exposed_ms = st.comm_exposed_ms + own_comm_.tied_ms;
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

void Trainer::take_device_times(StepMetrics& m) {
  if (device_ == Device::CPU) return;
  // The passes have run by now: their device times replace the launch times.
  PipelineStats dev;
  exec_->take_device_times(dev);
  m.forward_ms = dev.forward_ms + faults_->compute_delay_ms(m.step);  // the host's slow_rank sleep
  m.backward_ms = dev.backward_ms;
  m.tp_comm_ms = dev.tp_comm_ms;
  m.pp_bubble_ms += dev.bubble_ms;
}

// Every precision: one vote over the world, so that every rank skips the
// same steps. Under a dynamic loss scale a non-finite gradient is an
// overflow that the scale backs off from: expected, it does not count toward
// train.max_nonfinite_steps until the scale is at precision.min_scale (or
// fixed), where backing off cannot help. A non-finite loss always counts.
bool Trainer::skip_step(int step, double grad_norm, double local_loss) {
  const bool loss_bad = !std::isfinite(local_loss), norm_bad = !std::isfinite(grad_norm);
  double votes[2] = {loss_bad ? 1.0 : 0.0, norm_bad ? 1.0 : 0.0};
  grid_->world().all_reduce(Tensor(votes, {2}, DType::F64), ReduceOp::Sum);
  const bool any_loss = votes[0] > 0, skip = votes[0] > 0 || votes[1] > 0;
  const bool counted = any_loss || (skip && !loss_scale_.can_back_off());
  if (loss_scale_.enabled()) loss_scale_.update(skip);
  if (!skip) {
    nonfinite_run_ = 0;
    return loss_spike(step, local_loss);
  }
  if (!counted) return true;
  const std::string cause = nonfinite_cause(loss_bad, norm_bad, any_loss);
  if (++nonfinite_run_ == 1) nonfinite_first_ = str_cat("step ", step, ": ", cause);
  const int limit = cfg_.train.max_nonfinite_steps;
  if (nonfinite_run_ >= limit) {
    ckpt_->finish();  // a save in flight is from finite state (the decision is the same on every rank)
    fail(ErrorKind::Data, "training stopped at step ", step, ": ", limit, " step", limit > 1 ? "s" : "",
         " in a row skipped for non-finite values (train.max_nonfinite_steps=", limit, "); the first, ",
         nonfinite_first_);
  }
  if (is_logger())
    std::fprintf(stderr, "step %d: update skipped (%d of train.max_nonfinite_steps=%d in a row): %s\n", step,
                 nonfinite_run_, limit, cause.c_str());
  return true;
}

bool Trainer::loss_spike(int step, double local_loss) {
  const double z = cfg_.train.skip_loss_spikes_zscore;
  if (!(z > 0)) return false;
  if (!spike_guard_) spike_guard_.emplace(z);
  const double loss = global_loss(local_loss);
  // Every rank keeps the same window, but the vote makes the answer the same regardless.
  const bool spike = grid_->world().all_reduce_sum(spike_guard_->spike(loss) ? 1.0 : 0.0) > 0;
  if (spike && is_logger())
    std::fprintf(stderr,
                 "step %d: update skipped: loss %.4f is more than %g standard deviations above the mean %.4f "
                 "(standard deviation %.4f) of the last %zu steps (train.skip_loss_spikes_zscore)\n",
                 step, loss, z, spike_guard_->mean(), spike_guard_->stddev(), spike_guard_->compared());
  return spike;
}

std::string Trainer::nonfinite_cause(bool local_loss_bad, bool local_norm_bad, bool any_loss_bad) {
  Communicator& world = grid_->world();
  if (any_loss_bad) {
    const int from = lowest_rank_text(world, local_loss_bad, "").first;
    return str_cat("non-finite loss (first seen on rank ", from, ")");
  }
  // Scan this rank's gradients (those its norm covered) in parameter order.
  std::string name;
  for (const auto& seg : opt_->segments())
    if (local_norm_bad && name.empty() && !seg.tied_copy && !all_finite(seg.grad, ctx_.cuda_stream))
      name = params_[size_t(seg.param_index)].name;
  const auto [from, agreed] = lowest_rank_text(world, !name.empty(), name);
  if (from < 0) return "non-finite gradient norm (every gradient element is finite: the sum of squares overflowed)";
  return str_cat("non-finite gradient of parameter '", agreed, "' (on rank ", from, ")");
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
}

// The loss lives on the last stage; the global batch's is the mean over dp of equal-sized parts.
double Trainer::global_loss(double local_loss) {
  SpanScope span(ctx_.timeline, "loss_all_reduce");
  const double stage_loss = grid_->pp().all_reduce_sum(local_loss);
  return grid_->dp().all_reduce_sum(stage_loss) / cfg_.parallel.dp;
}

void Trainer::take_comm_times(StepMetrics& m) {
  m.dp_comm_ms = sync_->comm_ms();
  m.dp_comm_exposed_ms = sync_->exposed_ms();
}

void Trainer::save_checkpoint(StepMetrics& m) {
  Stopwatch cs;
  SpanScope span(ctx_.timeline, "checkpoint_save", Track::Main, -1, -1, m.step);
  ckpt_->save(m.step, ctx_.cuda_stream, ctx_.timeline);
  m.ckpt_stall_ms = cs.ms();
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
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  const int dp = cfg_.parallel.dp, dp_rank = grid_->coords().dp;
  const int p = cfg_.parallel.pp, rank = grid_->coords().pp;
  const PipeChannels& pipe = comm_->pipe();
  const int64_t n = std::min<int64_t>(cfg_.train.eval_batches, std::max<int64_t>(1, val_sampler_->samples_per_epoch() / B));
  io_.reset();
  Tensor tokens = io_.alloc({B, T}, DType::I32, "eval tokens"), targets = io_.alloc({B, T}, DType::I32, "eval targets");
  std::vector<int32_t> host_tokens(size_t(B) * T), host_targets(size_t(B) * T);
  double sum = 0;
  for (int64_t mb = dp_rank; mb < n; mb += dp) {
    if (chunks_.front()->placement().has_embedding || chunks_.back()->placement().has_head) {
      for (int b = 0; b < B; ++b)
        val_sampler_->fill(mb * B + b, host_tokens.data() + int64_t(b) * T, host_targets.data() + int64_t(b) * T);
      upload(tokens, host_tokens.data());
      upload(targets, host_targets.data());
    }
    // Forward only, through the chunks in model order; each stage waits for its input.
    for (size_t c = 0; c < chunks_.size(); ++c) {
      ModelChunk& g = *chunks_[c];
      // On the activation channel: the order (and, on NCCL, the device tensors) of training's transfers.
      if (!g.placement().has_embedding) pipe.act_recv->recv(g.stage_input(0), (rank + p - 1) % p, kEvalTag);
      g.forward(ctx_, 0, tokens, targets, 0.0);
      if (!g.placement().has_head) pipe.act_send->send(g.stage_output(0), (rank + 1) % p, kEvalTag);
    }
  }
  for (auto& c : chunks_) {
    sum += c->take_loss(ctx_);
    c->take_tp_comm();  // evaluation runs outside step_ms: its tensor-parallel time is no step's
  }
  sum = grid_->pp().all_reduce_sum(sum);  // only the last stage has losses
  return grid_->dp().all_reduce_sum(sum) / double(n);
}

}  // namespace xirang
