#include "runtime/trainer.h"

#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include "comm/ordered_link.h"
#include "comm/simulated_link.h"
#include "core/clock.h"
#include "core/device_memory.h"
#include "kernels/elementwise.h"
#include "runtime/checkpoint/checkpoint_io.h"
#ifdef XIRANG_HAVE_CUDA
#include "core/cuda_stream.h"
#include "kernels/cuda/context.h"
#endif
#ifdef XIRANG_HAVE_NCCL
#include "comm/nccl_groups.h"
#endif
#include "runtime/config/model_layout.h"

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

TokenDataset open_split(const std::string& dir, const char* key, const Config& cfg) {
  TokenDataset ds = TokenDataset::open(dir);
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

// device.backend=cuda is refused with the reason when it cannot run here.
void check_backend(const Config& c) {
  if (c.device.backend != Backend::CUDA) return;
#ifndef XIRANG_HAVE_CUDA
  fail(ErrorKind::Config, "device.backend=cuda: this build has no CUDA backend (configure with -DXIRANG_CUDA=ON "
                          "on a machine with the CUDA toolkit)");
#else
  if (!cuda_available())
    fail(ErrorKind::Config, "device.backend=cuda: no CUDA device is visible (cudaGetDeviceCount found none; "
                            "check CUDA_VISIBLE_DEVICES and the driver), use device.backend=cpu");
#ifndef XIRANG_HAVE_NCCL
  if (c.parallel.dp * c.parallel.tp * c.parallel.pp > 1)
    fail(ErrorKind::Config, "device.backend=cuda with dp ", c.parallel.dp, " x tp ", c.parallel.tp, " x pp ",
         c.parallel.pp, " needs NCCL, which this build did not find (set NCCL_ROOT and reconfigure)");
#endif
  if (c.comm.ordered_p2p)
    fail(ErrorKind::Config, "comm.ordered_p2p emulates NCCL's matching over MPI for the CPU backend; "
                            "device.backend=cuda uses NCCL itself");
#endif
}

constexpr int kEvalTag = 30000;

// Copies a host tensor's bytes into `dst`, which may live on a device.
void upload(Tensor dst, const void* host) {
  copy_bytes(dst.raw(), dst.device(), host, Device::CPU, dst.bytes(), nullptr, true);
}  // pipeline tags for evaluation, above any training tag in use

}  // namespace

struct Trainer::DeviceState {
#ifdef XIRANG_HAVE_CUDA
  std::unique_ptr<CudaContext> cuda;
#ifdef XIRANG_HAVE_NCCL
  std::unique_ptr<CudaStream> dp_stream;
  std::unique_ptr<NcclGroups> nccl;
#endif
#endif
};

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
  check_backend(cfg_);
  model_dtype_ = model_dtype_of(cfg_, opts_.dtype);
  init_device();
  if (cfg_.precision.loss_scale > 0)
    loss_scale_ = LossScale(cfg_.precision.loss_scale, false, cfg_.precision.growth_interval);
  else if (model_dtype_ == DType::F16)
    loss_scale_ = LossScale(cfg_.precision.initial_scale, true, cfg_.precision.growth_interval,
                            cfg_.precision.min_scale, cfg_.precision.hysteresis);
  const int p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages, m = cfg_.microbatches();
  if (p == 1 && v > 1)
    fail(ErrorKind::Config, "parallel.virtual_stages=", v, " needs parallel.pp > 1 (virtual stages interleave ranks)");
  schedule_kind_ = parse_schedule(cfg_.parallel.schedule, "parallel.schedule");
  schedule_ = make_schedule(schedule_kind_, p, grid_->coords().pp, m, v);

  // The data come first: a missing or corrupt dataset should fail before any large allocation.
  train_data_.emplace(open_split(cfg_.data.train, "data.train", cfg_));
  if (!cfg_.data.val.empty()) {
    val_data_.emplace(open_split(cfg_.data.val, "data.val", cfg_));
    val_sampler_ = std::make_unique<SequenceSampler>(*val_data_, cfg_.seq_len(), cfg_.train.seed, false);
  }

  build_chunks();

  std::vector<ModelChunk*> raw;
  for (auto& c : chunks_) raw.push_back(c.get());
  exec_ = std::make_unique<PipelineExecutor>(raw, pipe_, p, grid_->coords().pp, v, m);

  build_arenas();
  resume();
  build_loader();
  choose_peak();
}

void Trainer::init_device() {
  tp_comm_ = &grid_->tp();
  dp_grads_comm_ = &grid_->dp_grads();
  embedding_comm_ = &grid_->embedding();
  const int p = grid_->shape().pp;
  pipe_ = PipeChannels::shared(grid_->pp());
  if (cfg_.comm.ordered_p2p && p > 1) {
    // One link per edge colour and direction over the pp group; their tags
    // lie above the executor's and the evaluation's, below MPI's guaranteed 32767.
    std::vector<Communicator*> act, grad;
    for (int i = 0; i < 2 * pipe_colors(p); ++i) {
      const bool is_act = i < pipe_colors(p);
      const std::string name = str_cat(is_act ? "pp_act" : "pp_grads", i % pipe_colors(p));
      ordered_links_.push_back(std::make_unique<OrderedLink>(grid_->pp(), name, 32000 + 3 * i, cfg_.comm.timeout_s));
      (is_act ? act : grad).push_back(ordered_links_.back().get());
    }
    pipe_ = colored_pipe_channels(grid_->coords().pp, p, act, grad);
  }
  dev_ = std::make_unique<DeviceState>();
#ifdef XIRANG_HAVE_CUDA
  if (cfg_.device.backend == Backend::CUDA) {
    if (model_dtype_ == DType::F64) fail(ErrorKind::Config, "device.backend=cuda does not run f64 models");
    device_ = Device::CUDA;
    const bool alone = grid_->shape().world() == 1;
#ifdef XIRANG_HAVE_NCCL
    const int dev = alone ? 0 : node_local_device();
#else
    const int dev = 0;
#endif
    dev_->cuda = std::make_unique<CudaContext>(dev);
    ctx_ = dev_->cuda->kernel_context();
#ifdef XIRANG_HAVE_NCCL
    if (!alone) {
      // Gradient buckets on their own high-priority stream; tp on the compute stream.
      dev_->dp_stream = std::make_unique<CudaStream>(dev, StreamPriority::High);
      dev_->nccl = std::make_unique<NcclGroups>(*grid_, dev, NcclStreams{dev_->cuda->stream(), dev_->dp_stream->get()},
                                                p > 1 ? pipe_colors(p) : 0, CommOptions{cfg_.comm.timeout_s});
      tp_comm_ = &dev_->nccl->tp();
      dp_grads_comm_ = &dev_->nccl->dp_grads();
      embedding_comm_ = &dev_->nccl->embedding();
      if (p > 1) pipe_ = colored_pipe_channels(grid_->coords().pp, p, dev_->nccl->pp_act(), dev_->nccl->pp_grads());
    }
#endif
  }
#endif
}

void Trainer::build_arenas() {
  // Size every arena by running the carving code against measuring arenas.
  const int dp = cfg_.parallel.dp, p = cfg_.parallel.pp, v = cfg_.parallel.virtual_stages;
  const bool zero = cfg_.parallel.zero == 1;
  Arena mp = Arena::measuring("parameters"), mg = Arena::measuring("gradients");
  Arena ms = Arena::measuring("optimizer state"), mz = Arena::measuring("gradient shard");
  Arena ma = Arena::measuring("activations");
  for (auto& c : chunks_) c->layout_parameters(mp, mg);
  for (auto& c : chunks_) c->layout_activations(ma);
  exec_->layout(ma);
  int64_t local_params = 0;
  for (auto& c : chunks_) local_params += c->num_parameters();
  const DType grad_dtype = chunks_.front()->grad_dtype();
  const std::string per = count_str(double(local_params)) + " x " + dtype_name(model_dtype_);
  const std::string per_wide = count_str(double(local_params)) + " x " + dtype_name(grad_dtype);
  plan_.add("parameters", mp.used(), per);
  plan_.add("gradients", mg.used(), per_wide);
  // GradSync needs real parameter addresses for its offsets, so the
  // parameter and gradient arenas are created before the rest is measured.
  params_arena_ = Arena("parameters", mp.used(), device_);
  grads_ = Arena("gradients", mg.used(), device_);
  for (auto& c : chunks_) c->layout_parameters(params_arena_, grads_);
  params_.clear();
  for (auto& c : chunks_)
    for (auto& prm : c->parameters()) params_.push_back(prm);
  tied_.clear();
  tied_copies_.clear();
  for (auto& c : chunks_)
    for (Parameter* prm : c->tied_parameters()) (prm->tied_copy ? tied_copies_ : tied_).push_back(prm);
  sync_ = std::make_unique<GradSync>(params_, *dp_grads_comm_, &grid_->tp(), &grid_->pp(),
                                     GradSyncOptions{cfg_.parallel.bucket_mb, cfg_.parallel.overlap_grad_reduce, zero},
                                     &grid_->dp());
  opt_ = std::make_unique<AdamW>(cfg_.train);
  sync_->layout(mz);
  opt_->set_segments(sync_->optimizer_segments());
  opt_->layout_state(ms);
  const char* state_what = opt_->has_master() ? "AdamW m and v and fp32 master weights" : "AdamW m and v";
  plan_.add("optimizer state", ms.used(),
            zero ? str_cat(state_what, " of a 1/", dp, " shard (ZeRO-1)") : str_cat(state_what, ", ", per_wide, " each"));
  if (zero) plan_.add("gradient shard", mz.used(), str_cat("reduce-scattered gradients, 1/", dp));
  const ChunkBatch& batch = chunks_.front()->batch();
  plan_.add("activations", ma.used(),
            str_cat("micro_batch ", batch.micro_batch, " x seq_len ", batch.seq_len, " x ", batch.activation_slots,
                    " slot(s) x ", v, " chunk(s) of ", cfg_.model.n_layer / (p * v), " layer(s)",
                    cfg_.parallel.tp > 1 ? str_cat(", split over tp=", cfg_.parallel.tp) : "",
                    cfg_.parallel.sequence_parallel ? " with sequence parallelism" : ""));
  const size_t io_bytes = 2 * size_t(batch.micro_batch) * batch.seq_len * 4 + 2 * Arena::kAlignment;
  plan_.add("input batch", io_bytes, "evaluation tokens and targets, int32");
  if (opts_.print)
    std::fprintf(stderr, "%s",
                 plan_.table(str_cat("memory plan (per rank; dp=", dp, ", tp=", cfg_.parallel.tp, ", pp=", p,
                                     p > 1 ? str_cat(" ", schedule_name(schedule_kind_)) : "", "):"))
                     .c_str());
  // Asynchronous saves write from a host snapshot; so does every save of device memory.
  const bool snapshot = !cfg_.checkpoint.dir.empty() && (cfg_.checkpoint.async || device_ != Device::CPU);
  if (snapshot)
    plan_.add("checkpoint snapshot", mp.used() + ms.used(), "parameters and AdamW state, in host memory");
  plan_.check_limit(size_t(cfg_.memory.limit_gb * double(1ull << 30)), "memory.limit_gb");

  opt_state_ = Arena("optimizer state", ms.used(), device_);
  if (snapshot) snapshot_ = Arena("checkpoint snapshot", mp.used() + ms.used());
  shard_ = Arena("gradient shard", mz.used(), device_);
  acts_ = Arena("activations", ma.used(), device_);
  io_ = Arena("input batch", io_bytes, device_);
  sync_->layout(shard_);
  opt_->set_segments(sync_->optimizer_segments());
  opt_->layout_state(opt_state_);
  for (auto& c : chunks_) c->layout_activations(acts_);
  exec_->layout(acts_);
  // Every rank initialises its part of the model from the same seed: replicas
  // start identical, and shards equal slices of the one-rank model, without communication.
  for (auto& c : chunks_) {
    c->init_parameters(cfg_.train.seed);
    c->set_grad_ready_hook([this](int l) {
      // A tied original's gradient is final here: add its copies' contributions first.
      for (Parameter* t : tied_)
        if (t->layer == l) reduce_tied(*t);
      sync_->layer_done(l);
    });
  }
  opt_->init_master(ctx_);
}

void Trainer::build_loader() {
  // Only the ranks that need input read it: the first stage the tokens, the last the targets.
  const bool need_tokens = chunks_.front()->placement().has_embedding;
  const bool need_targets = chunks_.back()->placement().has_head;
  if (need_tokens || need_targets) {
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
}

void Trainer::choose_peak() {
  if (opts_.peak) peak_ = *opts_.peak;
  else if (cfg_.metrics.peak_tflops > 0) peak_ = {cfg_.metrics.peak_tflops * 1e12, "config metrics.peak_tflops"};
  else if (device_ != Device::CPU)
    // Dense tensor-core peak of an H100/H200 SXM (bf16/fp16; fp32 without TF32); other GPUs set metrics.peak_tflops.
    peak_ = {model_dtype_ == DType::F32 ? 66.9e12 : 989.4e12, "H100/H200 SXM datasheet (metrics.peak_tflops overrides)"};
  else peak_ = {measure_sgemm_flops(), "measured sgemm"};
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
                                      ChunkBatch{cfg_.train.micro_batch, cfg_.seq_len(), slots},
                                      TensorParallel{tp_comm_, cfg_.parallel.sequence_parallel}));
  }
}

void Trainer::reduce_tied(Parameter& p) {
  // On a device the compute stream waits for the sum; the host goes on (and
  // waits with the timeout at the end of the step).
  tied_work_.push_back(embedding_comm_->all_reduce_async(p.grad, ReduceOp::Sum));
  tied_work_.back()->join(ctx_.cuda_stream);
}

void Trainer::accumulate_gradients(int step, StepMetrics& m) {
  const int micro = cfg_.microbatches();
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  // d(mean loss of the global batch) / d(per-token loss): every microbatch has B*T tokens.
  // Under fp16 it is scaled up so that small gradients survive 16-bit storage.
  const double dloss = loss_scale_.scale() / (double(B) * T * micro * cfg_.parallel.dp);
  PipelineStats st;
  const auto feed = [&](int mb, const Tensor& tk, const Tensor& tg) { loader_->next(step, mb, tk, tg, ctx_.cuda_stream); };
  exec_->run(ctx_, schedule_, feed, dloss, st);
  // A tied copy (the last stage's token table) is final once its head
  // passes are done. Its reduction waits for the original's chunk to
  // finish, and so does the barrier after it on every stage: a stage that
  // finished its list early idles here until the pipeline has drained,
  // which is bubble too.
  Stopwatch drain;
  for (Parameter* t : tied_copies_) {
    reduce_tied(*t);
    sync_->layer_done(t->layer);
  }
  // (On a device the host has only queued the work: no barrier, the streams order it.)
  if (cfg_.parallel.pp > 1 && device_ == Device::CPU) grid_->pp().barrier();
  st.bubble_ms += drain.ms();
  m.forward_ms = st.forward_ms;
  m.backward_ms = st.backward_ms;
  // The time the step was blocked on input (the copy out of the queue is in st.data_ms too).
  m.data_wait_ms = loader_ ? loader_->take_wait_ms() : 0.0;
  m.data_prefetch_depth = loader_ ? loader_->depth() : 0;
  m.pp_bubble_ms = st.bubble_ms;
  m.pp_comm_exposed_ms = st.comm_exposed_ms;
}

double Trainer::evaluate() {
  XR_CHECK(val_sampler_, "evaluate() without data.val");
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  const int dp = cfg_.parallel.dp, dp_rank = grid_->coords().dp;
  const int p = cfg_.parallel.pp, rank = grid_->coords().pp;
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
      if (!g.placement().has_embedding) pipe_.act_recv->recv(g.stage_input(0), (rank + p - 1) % p, kEvalTag);
      g.forward(ctx_, 0, tokens, targets, 0.0);
      if (!g.placement().has_head) pipe_.act_send->send(g.stage_output(0), (rank + 1) % p, kEvalTag);
    }
  }
  for (auto& c : chunks_) sum += c->take_loss(ctx_);
  sum = grid_->pp().all_reduce_sum(sum);  // only the last stage has losses
  return grid_->dp().all_reduce_sum(sum) / double(n);
}

void Trainer::save_checkpoint(int64_t steps_done) {
  finish_save();  // one save in flight at a time
  CheckpointDir dir(cfg_.checkpoint.dir);
  Communicator& world = grid_->world();
  const std::string tmp = dir.tmp_dir(steps_done);
  if (is_logger()) dir.prepare(steps_done);
  world.barrier();
  // What this rank writes: each element once (data-parallel replicas and the
  // last stage's copy of the tied token table leave it to their twin).
  std::vector<SaveEntry> todo;
  const bool replica_writer = grid_->coords().dp == 0;
  for (const Parameter& p : params_)
    if (replica_writer && !p.tied_copy) todo.push_back({"params", p.name, p.shard, 0, p.value.numel(), p.value});
  const bool zero = cfg_.parallel.zero == 1;
  const auto& segs = opt_->segments();
  for (size_t i = 0; i < segs.size(); ++i) {
    const Parameter& p = params_[size_t(segs[i].param_index)];
    if (p.tied_copy || (!zero && !replica_writer)) continue;
    const int64_t b = segs[i].param_offset, e = b + segs[i].param.numel();
    todo.push_back({"adam_m", p.name, p.shard, b, e, opt_->m()[i]});
    todo.push_back({"adam_v", p.name, p.shard, b, e, opt_->v()[i]});
    if (opt_->has_master()) todo.push_back({"master", p.name, p.shard, b, e, opt_->master()[i]});
  }
  const bool async = cfg_.checkpoint.async;
  if (async || device_ != Device::CPU) {
    // The snapshot is what the step stalls for; the file is written behind training.
    snapshot_.reset();
    for (SaveEntry& e : todo) {
      Tensor copy = snapshot_.alloc(e.data.flat().shape(), e.data.dtype(), e.name);
      copy_tensor(copy, e.data.flat(), ctx_.cuda_stream, true);
      e.data = copy;
    }
  }
  const bool kill = cfg_.faults.kind == FaultKind::KillInSave && cfg_.faults.step == steps_done &&
                    cfg_.faults.rank == grid_->world_rank();
  // The dynamic loss scale's state (nothing when there is none to continue).
  const double scale = loss_scale_.dynamic() ? loss_scale_.scale() : 0.0;
  const int good_steps = loss_scale_.good_steps(), hysteresis_left = loss_scale_.hysteresis_left();
  const int64_t updates = opt_->updates();
  auto write = [this, tmp, steps_done, kill, scale, good_steps, hysteresis_left, updates,
                todo = std::move(todo)]() {
    try {
      RankCheckpointWriter w(tmp, grid_->world_rank(), steps_done);
      for (size_t i = 0; i < todo.size(); ++i) {
        const SaveEntry& e = todo[i];
        if (e.begin == 0 && e.end == e.data.numel() && e.group == "params")
          w.add(e.group, e.name, e.shard, e.data.view(shard_local_shape(e.shard)));
        else
          w.add(e.group, e.name, e.shard, e.begin, e.end, e.data, e.data.dtype());
        if (kill && i == todo.size() / 2) {  // fault injection: die with the rank file half written
          std::fprintf(stderr, "rank %d: injecting fault 'kill_in_save' at step %lld\n", grid_->world_rank(),
                       (long long)steps_done);
          std::fflush(stderr);
          std::raise(SIGKILL);
        }
      }
      // The data order is a pure function of (seed, step): the step is the loader's whole state.
      w.set_int("train.step", steps_done);
      w.set_int("optimizer.updates", updates);
      if (scale > 0) {
        w.set_double("precision.loss_scale", scale);
        w.set_int("precision.good_steps", good_steps);
        w.set_int("precision.hysteresis_left", hysteresis_left);
      }
      w.close();
    } catch (...) {
      save_error_ = std::current_exception();
    }
    save_done_ = true;
  };
  pending_step_ = steps_done;
  save_done_ = false;
  save_error_ = nullptr;
  if (async) {
    saver_ = std::thread(write);
  } else {
    write();
    finish_save();
  }
}

void Trainer::commit_save() {
  if (save_error_) std::rethrow_exception(save_error_);
  if (is_logger()) {
    CheckpointMeta meta;
    meta.step = pending_step_;
    meta.layout = CheckpointLayout{cfg_.parallel.dp, cfg_.parallel.tp, cfg_.parallel.pp, cfg_.parallel.zero,
                                   cfg_.parallel.virtual_stages, cfg_.parallel.sequence_parallel};
    meta.config_yaml = cfg_.yaml;
    CheckpointDir(cfg_.checkpoint.dir).commit(meta, cfg_.checkpoint.keep);
  }
  pending_step_ = -1;
}

void Trainer::poll_save() {
  if (pending_step_ < 0) return;
  // Every rank must have finished its file before rank 0 may commit.
  const double done = grid_->world().all_reduce_sum(save_done_ ? 1.0 : 0.0);
  if (done < grid_->shape().world()) return;
  if (saver_.joinable()) saver_.join();
  commit_save();
}

void Trainer::finish_save() {
  if (pending_step_ < 0) return;
  if (saver_.joinable()) saver_.join();
  grid_->world().barrier();
  commit_save();
  grid_->world().barrier();
}

Trainer::~Trainer() {
  // A save still in flight is completed only by finish_save() (run() calls
  // it); here the thread is only joined so that it never outlives the trainer.
  if (saver_.joinable()) saver_.join();
}

void Trainer::resume() {
  std::string path;
  if (cfg_.checkpoint.resume == ResumeMode::None) return;
  if (cfg_.checkpoint.resume == ResumeMode::Auto) {
    if (cfg_.checkpoint.dir.empty()) return;
    auto latest = CheckpointDir(cfg_.checkpoint.dir).latest();
    if (!latest) return;  // a fresh run
    path = *latest;
  } else {
    path = cfg_.checkpoint.resume_path;
  }
  CheckpointReader r = CheckpointReader::open(path);
  // A checkpoint of another model is refused before anything is overwritten.
  for (const Parameter& p : params_) {
    if (!r.has("params", p.name))
      fail(ErrorKind::Checkpoint, "checkpoint '", path, "' has no tensor '", p.name,
           "': it was saved from a different model");
    const Shape g = r.global_shape("params", p.name);
    if (g != p.shard.global)
      fail(ErrorKind::Checkpoint, "checkpoint '", path, "': tensor '", p.name, "' has shape ", g.str(),
           " but this model's is ", p.shard.global.str(), " (a different model.* shape)");
  }
  // A 16-bit run's fp32 masters are finer than its 16-bit weights: a wider run takes them.
  const bool wide = model_dtype_ == DType::F32 || model_dtype_ == DType::F64;
  for (Parameter& p : params_)
    read_checkpoint(r, wide && r.has("master", p.name) ? "master" : "params", p, 0, p.value.numel(), p.value);
  // A params-only checkpoint (an imported model, `ckpt convert --params-only`)
  // has no optimizer state: AdamW keeps the zeroed state it was built with.
  bool has_optimizer_state = false;
  for (const CheckpointEntry& e : r.entries()) has_optimizer_state = has_optimizer_state || e.group == "adam_m";
  if (!has_optimizer_state && opts_.print)
    std::fprintf(stderr, "checkpoint %s has no optimizer state (parameters only): AdamW starts fresh at step %lld\n",
                 path.c_str(), (long long)r.step());
  // The moments' bias correction continues from the saved update count
  // (older checkpoints: one update per step); fresh moments start from 0.
  if (has_optimizer_state)
    opt_->set_updates(r.has_scalar(0, "optimizer.updates") ? r.get_int(0, "optimizer.updates") : r.step());
  const auto& segs = opt_->segments();
  for (size_t i = 0; has_optimizer_state && i < segs.size(); ++i) {
    const Parameter& p = params_[size_t(segs[i].param_index)];
    const int64_t b = segs[i].param_offset, e = b + segs[i].param.numel();
    read_checkpoint(r, "adam_m", p, b, e, opt_->m()[i]);
    read_checkpoint(r, "adam_v", p, b, e, opt_->v()[i]);
  }
  // fp32 master weights: those a bf16/fp16 run saved, else the checkpoint's
  // parameters widened (an fp32 run's are the masters exactly).
  for (size_t i = 0; i < opt_->master().size(); ++i) {
    const Parameter& p = params_[size_t(segs[i].param_index)];
    const int64_t b = segs[i].param_offset, e = b + segs[i].param.numel();
    read_checkpoint(r, r.has("master", p.name) ? "master" : "params", p, b, e, opt_->master()[i]);
  }
  // The loss scale continues where it was (every rank saved the same value).
  if (loss_scale_.dynamic() && r.has_scalar(0, "precision.loss_scale"))
    loss_scale_.restore(r.get_double(0, "precision.loss_scale"), int(r.get_int(0, "precision.good_steps")),
                        r.has_scalar(0, "precision.hysteresis_left")
                            ? int(r.get_int(0, "precision.hysteresis_left"))
                            : cfg_.precision.hysteresis);
  start_step_ = r.step();
  if (start_step_ > cfg_.train.steps)
    fail(ErrorKind::Checkpoint, "checkpoint '", path, "' is at step ", start_step_, ", past train.steps=",
         cfg_.train.steps);
  if (opts_.print) std::fprintf(stderr, "resumed from %s at step %lld\n", path.c_str(), (long long)start_step_);
}

void Trainer::read_checkpoint(const CheckpointReader& r, std::string_view group, const Parameter& p, int64_t begin,
                              int64_t end, Tensor dst) {
  if (dst.device() == Device::CPU) {
    r.read(group, p.name, p.shard, begin, end, dst);
    return;
  }
  std::vector<char> host(dst.bytes());
  r.read(group, p.name, p.shard, begin, end, Tensor(host.data(), dst.flat().shape(), dst.dtype()));
  upload(dst, host.data());
}

void Trainer::inject_fault(int step) {
  const FaultConfig& f = cfg_.faults;
  if (f.kind == FaultKind::None || f.kind == FaultKind::KillInSave || f.step != step || f.rank != grid_->world_rank())
    return;
  std::fprintf(stderr, "rank %d: injecting fault '%s' at step %d\n", f.rank, config_name(f.kind), step);
  std::fflush(stderr);
  if (f.kind == FaultKind::Kill) std::raise(SIGKILL);
  if (f.kind == FaultKind::Hang)
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // a peer that stops answering
  if (f.kind == FaultKind::FailTransfer) {
    if (device_ != Device::CPU)
      fail(ErrorKind::Config, "faults.kind=fail_transfer fails the simulated MPI link of the dp channel; "
                              "device.backend=cuda moves gradients over NCCL");
    auto* link = dynamic_cast<SimulatedLink*>(&grid_->dp_grads());
    if (!link) fail(ErrorKind::Config, "faults.kind=fail_transfer needs the simulated link on the dp channel");
    link->fail_next(1);
  }
}

TrainResult Trainer::run() {
  TrainResult result;
  MetricsLog log(is_logger() ? cfg_.metrics.jsonl : std::string(), peak_);
  ProgressLine progress(cfg_.train.steps, cfg_.metrics.log_every);
  const double tokens_per_step = double(cfg_.train.global_batch) * cfg_.seq_len();
  // MFU per rank: this rank's share of the step's FLOPs against one rank's peak.
  const double flops_per_rank = chunks_.front()->flops_per_token() * tokens_per_step / grid_->shape().world();
  if (opts_.print) {
    int64_t total = 0;
    for (auto& c : chunks_) total += c->num_global_parameters();
    std::fprintf(stderr,
                 "model: %d layers, d_model %d, %d heads (%s parameters on this stage); layout dp %d x tp %d x pp %d%s%s; "
                 "%d steps of %.0f tokens; peak %.1f GFLOP/s per rank (%s)\n",
                 cfg_.model.n_layer, cfg_.model.d_model, cfg_.model.n_head, count_str(double(total)).c_str(),
                 cfg_.parallel.dp, cfg_.parallel.tp, cfg_.parallel.pp, cfg_.parallel.zero ? " (ZeRO-1)" : "",
                 cfg_.parallel.pp > 1 ? str_cat(" ", schedule_name(schedule_kind_)).c_str() : "", cfg_.train.steps,
                 tokens_per_step, peak_.flops / 1e9, peak_.source.c_str());
  }
  Stopwatch elapsed;
  const int last = cfg_.train.stop_after > 0 ? std::min(cfg_.train.stop_after, cfg_.train.steps) : cfg_.train.steps;
  for (int step = int(start_step_); step < last; ++step) {
    inject_fault(step + 1);
    poll_save();
    StepMetrics m;
    m.step = step + 1;
    Stopwatch sw;
    // The gradient arena holds only gradients (padding included): one fill for all of them.
    const DType gd = chunks_.front()->grad_dtype();
    zero(ctx_, Tensor(grads_.base(), {int64_t(grads_.used() / dtype_size(gd))}, gd, device_));
    sync_->begin_step();
    accumulate_gradients(step, m);
    sync_->finish(ctx_.cuda_stream);
    if (device_ != Device::CPU) {
      // Timed host waits for the transfers the compute stream joined, before
      // the step's untimed stream synchronization (a dead peer fails here).
      exec_->wait_sends();
      for (auto& w : tied_work_) w->wait();
    }
    tied_work_.clear();
    Stopwatch ow;
    const double scale = loss_scale_.scale();
    m.loss_scale = scale;
    // The step's one host wait (on a device): the norm decides clipping and skipping.
    m.grad_norm = sync_->grad_norm(ctx_, *opt_) / scale;
    // The forwards are done by now, so reading the loss costs no further wait.
    double local_loss = 0;
    for (auto& c : chunks_) local_loss += c->take_loss(ctx_);
    local_loss /= cfg_.microbatches();
    if (device_ != Device::CPU) {
      // The passes have run by now: their device times replace the launch times.
      PipelineStats dev;
      exec_->take_device_times(dev);
      m.forward_ms = dev.forward_ms;
      m.backward_ms = dev.backward_ms;
      m.pp_bubble_ms += dev.bubble_ms;
    }
    m.lr = lr_at(cfg_.train, step);
    if (loss_scale_.enabled()) {
      // The norm is reduced over tp and pp (and dp under ZeRO); the vote over
      // the world makes the skip decision identical on every rank regardless.
      const bool overflow = grid_->world().all_reduce_sum(std::isfinite(m.grad_norm) ? 0.0 : 1.0) > 0;
      m.skipped = overflow;
      loss_scale_.update(overflow);
    }
    if (!m.skipped) {
      opt_->step(ctx_, m.lr, clip_scale(cfg_.train.grad_clip, m.grad_norm) / scale);
      sync_->gather_parameters();
    }
    m.optimizer_ms = ow.ms();
    // The loss lives on the last stage; the global batch's is the mean over dp of equal-sized parts.
    const double stage_loss = grid_->pp().all_reduce_sum(local_loss);
    m.loss = grid_->dp().all_reduce_sum(stage_loss) / cfg_.parallel.dp;
    m.dp_comm_ms = sync_->comm_ms();
    m.dp_comm_exposed_ms = sync_->exposed_ms();
    for (auto& c : chunks_) m.tp_comm_ms += c->take_tp_comm_ms();
    // A checkpoint's stall belongs to the step that saves (it is part of step_ms).
    const bool save_now = !cfg_.checkpoint.dir.empty() &&
                          ((cfg_.checkpoint.every > 0 && m.step % cfg_.checkpoint.every == 0) || m.step == last);
    if (save_now) {
      Stopwatch cs;
      save_checkpoint(m.step);
      m.ckpt_stall_ms = cs.ms();
    }
    m.step_ms = sw.ms();
    m.tokens_per_s = tokens_per_step / (m.step_ms / 1e3);
    m.mfu = flops_per_rank / (m.step_ms / 1e3) / peak_.flops;
    const bool eval_now = cfg_.train.eval_every > 0 && (m.step % cfg_.train.eval_every == 0 || m.step == cfg_.train.steps);
    if (eval_now && val_sampler_) {
      m.val_loss = evaluate();
      result.final_val_loss = m.val_loss;
    }
    result.losses.push_back(m.loss);
    result.grad_norms.push_back(m.grad_norm);
    result.steps.push_back(m);
    log.write(m);
    if (opts_.print) progress.update(m, elapsed.seconds());
  }
  finish_save();
  if (opts_.print) progress.finish();
  return result;
}

}  // namespace xirang
