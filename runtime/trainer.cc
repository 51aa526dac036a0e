#include "runtime/trainer.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include "comm/simulated_link.h"
#include "core/clock.h"

namespace xirang {

namespace {

GPT2Shape model_shape(const Config& c) {
  GPT2Shape s;
  s.n_layer = c.model.n_layer;
  s.n_head = c.model.n_head;
  s.d_model = c.model.d_model;
  s.max_seq_len = c.model.seq_len;
  s.vocab_size = c.model.vocab_size;
  s.padded_vocab = c.model.padded_vocab();
  return s;
}

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

}  // namespace

Trainer::Trainer(const Config& cfg, TrainerOptions opts, ProcessGrid* grid) : cfg_(cfg), opts_(opts), grid_(grid) {
  if (!grid_) {
    own_grid_ = ProcessGrid::single();
    grid_ = own_grid_.get();
  }
  const GridShape& gs = grid_->shape();
  if (gs.dp != cfg_.parallel.dp || gs.tp != cfg_.parallel.tp || gs.pp != cfg_.parallel.pp)
    fail(ErrorKind::Config, "the process grid (dp ", gs.dp, ", tp ", gs.tp, ", pp ", gs.pp,
         ") does not match parallel.dp=", cfg_.parallel.dp, ", tp=", cfg_.parallel.tp, ", pp=", cfg_.parallel.pp);
  if (cfg_.parallel.pp != 1)
    fail(ErrorKind::Config, "parallel.pp=", cfg_.parallel.pp,
         ": pipeline parallelism is not built yet (set parallel.pp=1)");
  opts_.print = opts_.print && is_logger();

  GPT2Batch batch{cfg_.train.micro_batch, cfg_.seq_len(), 1};
  model_ = std::make_unique<GPT2>(model_shape(cfg_), GPT2Stage::whole(model_shape(cfg_)), opts_.dtype, batch,
                                  GPT2Parallel{&grid_->tp(), cfg_.parallel.sequence_parallel});

  // The data come first: a missing or corrupt dataset should fail before any large allocation.
  train_data_.emplace(open_split(cfg_.data.train, "data.train", cfg_));
  train_sampler_ = std::make_unique<SequenceSampler>(*train_data_, cfg_.seq_len(), cfg_.train.seed, true);
  if (!cfg_.data.val.empty()) {
    val_data_.emplace(open_split(cfg_.data.val, "data.val", cfg_));
    val_sampler_ = std::make_unique<SequenceSampler>(*val_data_, cfg_.seq_len(), cfg_.train.seed, false);
  }

  // Size every arena by running the carving code against measuring arenas.
  const int dp = cfg_.parallel.dp;
  const bool zero = cfg_.parallel.zero == 1;
  Arena mp = Arena::measuring("parameters"), mg = Arena::measuring("gradients");
  Arena ms = Arena::measuring("optimizer state"), mz = Arena::measuring("gradient shard");
  Arena ma = Arena::measuring("activations");
  model_->layout_parameters(mp, mg);
  model_->layout_activations(ma);
  // GradSync needs real parameter addresses for its offsets, so the
  // parameter and gradient arenas are created before the rest is measured.
  const int64_t n = model_->num_parameters();
  const std::string per = count_str(double(n)) + " x " + dtype_name(opts_.dtype);
  plan_.add("parameters", mp.used(), per);
  plan_.add("gradients", mg.used(), per);
  params_ = Arena("parameters", mp.used());
  grads_ = Arena("gradients", mg.used());
  model_->layout_parameters(params_, grads_);
  sync_ = std::make_unique<GradSync>(model_->parameters(), grid_->dp_grads(), &grid_->tp(),
                                     GradSyncOptions{cfg_.parallel.bucket_mb, cfg_.parallel.overlap_grad_reduce, zero});
  opt_ = std::make_unique<AdamW>(cfg_.train);
  sync_->layout(mz);
  opt_->set_segments(sync_->optimizer_segments());
  opt_->layout_state(ms);
  plan_.add("optimizer state", ms.used(),
            zero ? str_cat("AdamW m and v of a 1/", dp, " shard (ZeRO-1)") : "AdamW m and v, " + per + " each");
  if (zero) plan_.add("gradient shard", mz.used(), str_cat("reduce-scattered gradients, 1/", dp));
  plan_.add("activations", ma.used(),
            str_cat("micro_batch ", batch.micro_batch, " x seq_len ", batch.seq_len, " x ", batch.activation_slots,
                    " slot(s)", cfg_.parallel.tp > 1 ? str_cat(", split over tp=", cfg_.parallel.tp) : "",
                    cfg_.parallel.sequence_parallel ? " with sequence parallelism" : ""));
  const size_t io_bytes = 2 * size_t(batch.micro_batch) * batch.seq_len * 4 + 2 * Arena::kAlignment;
  plan_.add("input batch", io_bytes, "tokens and targets, int32");
  if (opts_.print)
    std::fprintf(stderr, "%s",
                 plan_.table(str_cat("memory plan (per rank; dp=", dp, ", tp=", cfg_.parallel.tp, "):")).c_str());
  plan_.check_limit(size_t(cfg_.memory.limit_gb * double(1ull << 30)), "memory.limit_gb");

  opt_state_ = Arena("optimizer state", ms.used());
  shard_ = Arena("gradient shard", mz.used());
  acts_ = Arena("activations", ma.used());
  io_ = Arena("input batch", io_bytes);
  sync_->layout(shard_);
  opt_->set_segments(sync_->optimizer_segments());
  opt_->layout_state(opt_state_);
  model_->layout_activations(acts_);
  tokens_ = io_.alloc({batch.micro_batch, batch.seq_len}, DType::I32, "tokens");
  targets_ = io_.alloc({batch.micro_batch, batch.seq_len}, DType::I32, "targets");
  // Every rank initialises its part of the model from the same seed: replicas
  // start identical, and shards equal slices of the one-rank model, without communication.
  model_->init_parameters(cfg_.train.seed);
  model_->set_grad_ready_hook([this](int l) { sync_->layer_done(l); });

  if (opts_.peak) peak_ = *opts_.peak;
  else if (cfg_.metrics.peak_tflops > 0) peak_ = {cfg_.metrics.peak_tflops * 1e12, "config metrics.peak_tflops"};
  else peak_ = {measure_sgemm_flops(), "measured sgemm"};
}

double Trainer::accumulate_gradients(int step, StepMetrics& m) {
  const int micro = cfg_.microbatches();
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  const int dp = cfg_.parallel.dp, dp_rank = grid_->coords().dp;
  // d(mean loss of the global batch) / d(per-token loss): every microbatch has B*T tokens.
  const double dloss = 1.0 / (double(B) * T * micro * dp);
  const int64_t per_rank = cfg_.train.global_batch / dp;
  double loss_sum = 0;
  for (int mb = 0; mb < micro; ++mb) {
    Stopwatch data;
    for (int b = 0; b < B; ++b) {
      // This rank's contiguous part of the global batch, microbatch by microbatch.
      const int64_t k = dp_rank * per_rank + int64_t(mb) * B + b;
      train_sampler_->fill(SequenceSampler::global_index(step, cfg_.train.global_batch, k),
                           tokens_.data<int32_t>() + int64_t(b) * T, targets_.data<int32_t>() + int64_t(b) * T);
    }
    m.data_wait_ms += data.ms();
    Stopwatch fw;
    loss_sum += model_->forward(ctx_, 0, tokens_, targets_, dloss);
    m.forward_ms += fw.ms();
    // Only the last microbatch's backward makes gradients final.
    const bool last = mb == micro - 1;
    Stopwatch bw;
    model_->backward(ctx_, 0, tokens_, last ? GradPhase::Final : GradPhase::Accumulate);
    m.backward_ms += bw.ms();
  }
  return loss_sum / micro;
}

double Trainer::evaluate() {
  XR_CHECK(val_sampler_, "evaluate() without data.val");
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  const int dp = cfg_.parallel.dp, dp_rank = grid_->coords().dp;
  const int64_t n = std::min<int64_t>(cfg_.train.eval_batches, std::max<int64_t>(1, val_sampler_->samples_per_epoch() / B));
  double sum = 0;
  for (int64_t mb = dp_rank; mb < n; mb += dp) {
    for (int b = 0; b < B; ++b)
      val_sampler_->fill(mb * B + b, tokens_.data<int32_t>() + int64_t(b) * T, targets_.data<int32_t>() + int64_t(b) * T);
    sum += model_->forward(ctx_, 0, tokens_, targets_, 0.0);
  }
  return grid_->dp().all_reduce_sum(sum) / double(n);
}

void Trainer::inject_fault(int step) {
  const FaultConfig& f = cfg_.faults;
  if (f.kind == "none" || f.step != step || f.rank != grid_->world_rank()) return;
  std::fprintf(stderr, "rank %d: injecting fault '%s' at step %d\n", f.rank, f.kind.c_str(), step);
  std::fflush(stderr);
  if (f.kind == "kill") std::raise(SIGKILL);
  if (f.kind == "hang")
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // a peer that stops answering
  if (f.kind == "fail_transfer") {
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
  const double flops_per_rank = model_->flops_per_token() * tokens_per_step / grid_->shape().world();
  if (opts_.print)
    std::fprintf(stderr,
                 "model: %s parameters, %d layers, d_model %d, %d heads; layout dp %d x tp %d x pp %d%s; %d steps of "
                 "%.0f tokens; peak %.1f GFLOP/s per rank (%s)\n",
                 count_str(double(model_->num_global_parameters())).c_str(), cfg_.model.n_layer, cfg_.model.d_model,
                 cfg_.model.n_head, cfg_.parallel.dp, cfg_.parallel.tp, cfg_.parallel.pp,
                 cfg_.parallel.zero ? " (ZeRO-1)" : "", cfg_.train.steps, tokens_per_step, peak_.flops / 1e9,
                 peak_.source.c_str());
  Stopwatch elapsed;
  for (int step = 0; step < cfg_.train.steps; ++step) {
    inject_fault(step + 1);
    StepMetrics m;
    m.step = step + 1;
    Stopwatch sw;
    for (auto& p : model_->parameters()) std::memset(p.grad.raw(), 0, p.grad.bytes());
    sync_->begin_step();
    const double local_loss = accumulate_gradients(step, m);
    sync_->finish();
    Stopwatch ow;
    m.grad_norm = sync_->grad_norm(ctx_, *opt_);
    m.lr = lr_at(cfg_.train, step);
    opt_->step(ctx_, step + 1, m.lr, clip_scale(cfg_.train.grad_clip, m.grad_norm));
    sync_->gather_parameters();
    m.optimizer_ms = ow.ms();
    // The logged loss is the global batch's: the mean over dp ranks of equal-sized parts.
    m.loss = grid_->dp().all_reduce_sum(local_loss) / cfg_.parallel.dp;
    m.dp_comm_ms = sync_->comm_ms();
    m.dp_comm_exposed_ms = sync_->exposed_ms();
    m.tp_comm_ms = model_->take_tp_comm_ms();
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
  if (opts_.print) progress.finish();
  return result;
}

}  // namespace xirang
