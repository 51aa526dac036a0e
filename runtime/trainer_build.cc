#include "runtime/trainer.h"

// Building a Trainer: the schedule, data, model chunks, arenas and their
// memory plan, optimizer, loader and observers (runtime/trainer.h). The
// training loop is runtime/trainer.cc.

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/clock.h"
#include "core/device_memory.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "runtime/observe/baseline.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/model_layout.h"
#include "runtime/memory_estimate.h"
#include "runtime/observe/prometheus_exporter.h"
#include "runtime/observe/step_watchers.h"
#include "runtime/observe/straggler.h"

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

}  // namespace

// ---------------------------------------------------------------------------
// Construction

Trainer::Trainer(const Config& cfg, TrainerOptions opts, ProcessGrid* grid) : cfg_(cfg), opts_(opts), grid_(grid) {
  if (!grid_) {
    own_grid_ = ProcessGrid::single();
    grid_ = own_grid_.get();
  }
  const GridShape& gs = grid_->shape();
  if (gs.dp != cfg_.parallel.dp || gs.cp != cfg_.parallel.cp || gs.tp != cfg_.parallel.tp || gs.pp != cfg_.parallel.pp)
    fail(ErrorKind::Config, "the process grid (dp ", gs.dp, ", cp ", gs.cp, ", tp ", gs.tp, ", pp ", gs.pp,
         ") does not match parallel.dp=", cfg_.parallel.dp, ", cp=", cfg_.parallel.cp, ", tp=", cfg_.parallel.tp,
         ", pp=", cfg_.parallel.pp);
  opts_.print = opts_.print && is_logger();
  model_dtype_ = model_dtype_of(cfg_, opts_.dtype);
  comm_ = std::make_unique<CommGroups>(cfg_, *grid_, model_dtype_);
  device_ = comm_->device();
  ctx_ = comm_->kernel_context();
  if (cfg_.metrics.op_profile || !cfg_.metrics.trace.empty()) ctx_.timeline = &timeline_;
  ctx_.clock = &clock_;
  timeline_.set_profiling(cfg_.metrics.op_profile);
  timeline_.set_device_events(&clock_.device_events());  // the step's one pool of timing events
  faults_ = std::make_unique<FaultInjector>(cfg_.faults, *grid_, device_);
  loss_scale_ = loss_scale_of(cfg_.precision, model_dtype_);
  build_schedule();
  open_data();
  build_chunks();
  std::vector<ModelChunk*> raw;
  for (auto& c : chunks_) raw.push_back(c.get());
  exec_ = std::make_unique<PipelineExecutor>(raw, comm_->pipe(), chunk_map(cfg_.parallel), grid_->coords().pp,
                                             cfg_.microbatches());
  build_arenas();
  start_step_ = ckpt_->resume(model_dtype_);
  build_loader();
  choose_peak();
  build_energy_meter();
  build_observers();
  build_guard();
}

// The step's skip vote (runtime/resilience/guards.h) with what only the
// trainer knows: the job's loss, which gradient is not finite, the
// checkpoint writer to finish before the run stops.
void Trainer::build_guard() {
  StepGuard::Hooks hooks;
  hooks.global_loss = [this](double local_loss) { return global_loss(local_loss); };
  hooks.bad_gradient = [this] {
    for (const auto& seg : opt_->segments())
      if (!seg.tied_copy && !all_finite(seg.grad, ctx_.cuda_stream)) return params_[size_t(seg.param_index)].name;
    return std::string();
  };
  hooks.before_failing = [this] { ckpt_->finish(); };
  guard_ = std::make_unique<StepGuard>(cfg_.train, grid_->world(), loss_scale_, is_logger(), std::move(hooks));
}

Trainer::~Trainer() = default;

void Trainer::build_schedule() {
  const int p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages, m = cfg_.microbatches();
  if (p == 1 && v > 1)
    fail(ErrorKind::Config, "parallel.virtual_stages=", v, " needs parallel.pp > 1 (virtual stages interleave ranks)");
  schedule_kind_ = cfg_.parallel.schedule;
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
  const ModelDims& dims = cfg_.model;
  const ModelArch& arch = model_arch(dims.arch);
  const int p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages, rank = grid_->coords().pp;
  const ChunkMap map = chunk_map(cfg_.parallel);
  // Slots: the most microbatches the schedule keeps alive per chunk in
  // each pool, plus the receives the executor posts ahead.
  const SlotCounts slots = slot_counts(schedule_, v, p > 1 ? 2 : 0);
  // This rank's part of each sequence (its cp rank's rows) and the group its attention gathers over.
  ChunkBatch batch = chunk_batch(cfg_, slots.activation, slots.input, slots.weight);
  batch.cp.group = &comm_->cp();
  batch.cp.rank = grid_->coords().cp;
  chunks_.clear();
  for (int c = 0; c < v; ++c) {
    chunks_.push_back(arch.make_chunk(dims, map.placement(dims.n_layer, rank, c), model_dtype_, batch,
                                      TensorParallel{&comm_->tp(), cfg_.parallel.sequence_parallel}));
    if (splits_backward(schedule_kind_) && !chunks_.back()->splits_backward())
      fail(ErrorKind::Config, "parallel.schedule=", schedule_name(schedule_kind_),
           " splits each backward in two, which model.arch=", dims.arch, " cannot");
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
  const size_t rows = size_t(batch.cp.split(batch.seq_len).local_rows());  // this cp rank's T / cp
  const size_t io_bytes = 2 * size_t(batch.micro_batch) * rows * 4 + 2 * Arena::kAlignment;
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
  local_tied_.clear();
  for (auto& c : chunks_)
    for (Parameter* prm : c->tied_parameters()) (prm->tied_copy ? tied_copies_ : tied_).push_back(prm);
  // An original and its copy on this rank (zb_v): a local sum, kept out of the embedding group's.
  for (auto o = tied_.begin(); o != tied_.end();) {
    auto c = std::find_if(tied_copies_.begin(), tied_copies_.end(), [&](Parameter* t) { return t->name == (*o)->name; });
    if (c == tied_copies_.end()) {
      ++o;
      continue;
    }
    local_tied_.emplace_back(*o, *c);
    tied_copies_.erase(c);
    o = tied_.erase(o);
  }
}

// Gradient sync, AdamW over its segments, and the checkpointer of both.
void Trainer::build_optimizer(Arena& measure_shard, Arena& measure_state) {
  // Parameters are replicated over dp x cp: their gradients sum over both
  // (the buckets' channel), ZeRO-1 shards over both, and the norm's host
  // scalar travels over the same ranks.
  sync_ = std::make_unique<GradSync>(
      params_, comm_->dp_grads(), &grid_->tp(), &grid_->pp(),
      GradSyncOptions{cfg_.parallel.bucket_mb, cfg_.parallel.overlap_grad_reduce, cfg_.parallel.zero == 1},
      &grid_->dp_cp());
  opt_ = std::make_unique<AdamW>(cfg_.train);
  sync_->set_timeline(ctx_.timeline);
  sync_->set_clock(&clock_);
  sync_->layout(measure_shard);
  opt_->set_segments(sync_->optimizer_segments());
  opt_->layout_state(measure_state);
  ckpt_ = std::make_unique<Checkpointer>(cfg_, *grid_, TrainingState{params_, opt_->checkpoint_state(), loss_scale_},
                                         device_, faults_->save_faults(), opts_.print);
}

void Trainer::plan_memory(const ArenaSizes& sizes) {
  const int dp = cfg_.parallel.dp, cp = cfg_.parallel.cp, p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages;
  const int shards = dp * cp;  // ZeRO-1 shards over every copy of the parameters
  const bool zero = cfg_.parallel.zero == 1;
  int64_t local_params = 0;
  for (auto& c : chunks_) local_params += c->num_parameters();
  const std::string per = count_str(double(local_params)) + " x " + dtype_name(model_dtype_);
  const std::string per_wide = count_str(double(local_params)) + " x " + dtype_name(chunks_.front()->grad_dtype());
  plan_.add("parameters", sizes.params, per);
  plan_.add("gradients", sizes.grads, per_wide);
  const char* state_what = opt_->has_master() ? "AdamW m and v and fp32 master weights" : "AdamW m and v";
  plan_.add("optimizer state", sizes.opt_state,
            zero ? str_cat(state_what, " of a 1/", shards, " shard (ZeRO-1)") : str_cat(state_what, ", ", per_wide, " each"));
  if (zero) plan_.add("gradient shard", sizes.shard, str_cat("reduce-scattered gradients, 1/", shards));
  const ChunkBatch& batch = chunks_.front()->batch();
  plan_.add("activations", sizes.acts,
            str_cat("micro_batch ", batch.micro_batch, " x seq_len ", batch.seq_len,
                    cp > 1 ? str_cat(" / cp ", cp) : "", " x ", batch.activation_slots,
                    " slot(s)",
                    batch.split_backward ? str_cat(" (split backward: ", batch.inputs(), " input, ", batch.weights(),
                                                   " weight slot(s))")
                                         : "",
                    " x ", v, " chunk(s) of ", cfg_.model.n_layer / (p * v), " layer(s)",
                    cfg_.parallel.tp > 1 ? str_cat(", split over tp=", cfg_.parallel.tp) : "",
                    cfg_.parallel.sequence_parallel ? " with sequence parallelism" : ""));
  plan_.add("input batch", sizes.io, "evaluation tokens and targets, int32");
  if (opts_.print) {
    std::fprintf(stderr, "%s",
                 plan_.table(str_cat("memory plan (per rank; dp=", dp, cp > 1 ? str_cat(", cp=", cp) : "",
                                     ", tp=", cfg_.parallel.tp, ", pp=", p,
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
  for (Recompute m : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    Config c = cfg_;
    c.train.recompute = m;
    const ActivationSplit split = activation_split(c, {at.pp, at.tp, at.dp, at.cp});
    line += str_cat(m == Recompute::None ? " " : ", ", recompute_name(c.train.recompute), " ",
                    format_bytes(split.per_slot));
  }
  return line + str_cat(" (train.recompute=", recompute_name(cfg_.train.recompute), ")");
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
      // The copy's gradient is final by now: the head's table gradient is taken in its chunk's
      // input-gradient pass, which comes before the first chunk's last backward on the V.
      for (auto& [original, copy] : local_tied_)
        if (original->layer == l) sum_tied_locally(*original, *copy);
      sync_->layer_done(l);
    });
  }
  opt_->init_master(ctx_);
}

// The rows of each sample this rank's chunks hold: its cp rank's two chunks,
// lower first (the chunk's ContextSplit decides which); all T when cp = 1.
SampleRows Trainer::sample_rows() const {
  const ChunkBatch& b = chunks_.front()->batch();
  const ContextSplit split = b.cp.split(b.seq_len);
  SampleRows rows;
  if (split.ranks == 1) return rows;
  rows.length = split.chunk();
  for (int part = 0; part < 2; ++part) rows.starts.push_back(split.chunk_of(b.cp.rank, part) * split.chunk());
  return rows;
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
  // Every cp rank of a dp rank reads the same samples, each only its own rows.
  spec.rows = sample_rows();
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

// The metrics' exporters and monitors (runtime/observe/step_observer.h), in the
// order they see each step.
void Trainer::build_observers() {
  observers_.clear();
  // The monitors fill the step's metrics before the exporter publishes them.
  if (cfg_.metrics.straggler_every > 0) observers_.push_back(std::make_unique<StragglerDetector>(cfg_.metrics, *grid_));
  if (!cfg_.metrics.baseline.empty()) observers_.push_back(std::make_unique<BaselineMonitor>(cfg_.metrics, is_logger()));
  add_prometheus_exporter(observers_, cfg_.metrics, grid_->world_rank(),
                          {tokens_per_step(), double(plan_.total()), energy_ != nullptr});
  // Then what the run writes as it goes: metrics.jsonl (world rank 0), the progress line, the trace window.
  if (is_logger() && !cfg_.metrics.jsonl.empty())
    observers_.push_back(std::make_unique<JsonlObserver>(
        cfg_.metrics.jsonl, peak_,
        JsonlFields{cfg_.metrics.straggler_every > 0, !cfg_.metrics.baseline.empty(), cfg_.metrics.op_profile},
        plan_.total(), device_ == Device::CPU ? "cpu" : "cuda",
        energy_ ? energy_source_name(energy_->source()) : std::string()));
  if (opts_.print) observers_.push_back(std::make_unique<ProgressObserver>(cfg_.train.steps, cfg_.metrics.log_every));
  observers_.push_back(std::make_unique<TraceObserver>(cfg_.metrics, *grid_, timeline_));
}

void Trainer::build_energy_meter() {
  // The CPU backend has no energy counter on these machines (no RAPL): no meter, no fields.
  if (device_ == Device::CPU) return;
  energy_ = std::make_unique<EnergyMeter>("libnvidia-ml.so.1", comm_->pci_bus_id());
  if (energy_->measuring()) return;
  if (opts_.print)
    std::fprintf(stderr, "warning: energy not measured (NVML: %s); metrics.jsonl has no joules_per_token or avg_watts\n",
                 energy_->reason().c_str());
  energy_.reset();
}

void Trainer::choose_peak() {
  if (opts_.peak) peak_ = *opts_.peak;
  else if (cfg_.metrics.peak_tflops > 0) peak_ = {cfg_.metrics.peak_tflops * 1e12, "config metrics.peak_tflops"};
  else if (device_ != Device::CPU)
    // The device's own matrix-product rate in the model's dtype, measured
    // now (about 20 ms on an H200): the datasheet's dense peak (989 TFLOP/s
    // bf16 on an H100/H200) is not reached in practice.
    peak_ = {measure_device_gemm_flops(ctx_, model_dtype_),
             str_cat("measured ", dtype_name(model_dtype_), " GEMM 8192^3 (metrics.peak_tflops overrides)")};
  else peak_ = {measure_sgemm_flops(), "measured sgemm"};
}

void Trainer::print_run() const {
  int64_t total = 0;
  for (auto& c : chunks_) total += c->num_global_parameters();
  std::fprintf(stderr,
               "model: %d layers, d_model %d, %d heads (%s parameters on this stage); layout dp %d x cp %d%s x tp %d x pp %d%s%s; "
               "%d steps of %.0f tokens; peak %.1f GFLOP/s per rank (%s)\n",
               cfg_.model.n_layer, cfg_.model.d_model, cfg_.model.n_head, count_str(double(total)).c_str(),
               cfg_.parallel.dp, cfg_.parallel.cp,
               cfg_.parallel.cp > 1 ? str_cat(" (", config_name(cfg_.parallel.cp_split), ")").c_str() : "",
               cfg_.parallel.tp, cfg_.parallel.pp, cfg_.parallel.zero ? " (ZeRO-1)" : "",
               cfg_.parallel.pp > 1 ? str_cat(" ", schedule_name(schedule_kind_)).c_str() : "", cfg_.train.steps,
               tokens_per_step(), peak_.flops / 1e9, peak_.source.c_str());
  if (device_ == Device::CPU) std::fprintf(stderr, "cpu gemm: %s\n", cpu_gemm_path().c_str());
  // The kernels layer owns the dispatch rule, which depends on the head width (model.head_dim).
  std::fprintf(stderr, "attention: %s\n",
               flash_attention_path_name(device_, model_dtype_, cfg_.model.head_size()).c_str());
}

}  // namespace xirang
