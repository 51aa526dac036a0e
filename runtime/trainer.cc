#include "runtime/trainer.h"

#include <cstdio>

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

}  // namespace

Trainer::Trainer(const Config& cfg, TrainerOptions opts) : cfg_(cfg), opts_(opts) {
  if (cfg_.parallel.dp * cfg_.parallel.tp * cfg_.parallel.pp != 1)
    fail(ErrorKind::Config, "this build trains on one rank only: parallel.dp=", cfg_.parallel.dp,
         ", parallel.tp=", cfg_.parallel.tp, ", parallel.pp=", cfg_.parallel.pp, " must all be 1");
  GPT2Batch batch{cfg_.train.micro_batch, cfg_.seq_len(), 1};
  model_ = std::make_unique<GPT2>(model_shape(cfg_), GPT2Stage::whole(model_shape(cfg_)), opts_.dtype, batch);
  opt_ = std::make_unique<AdamW>(model_->parameters(), cfg_.train);

  // The data come first: a missing or corrupt dataset should fail before any large allocation.
  train_data_.emplace(TokenDataset::open(cfg_.data.train));
  if (train_data_->index().vocab_size > cfg_.model.vocab_size)
    fail(ErrorKind::Config, "data.train: dataset vocabulary ", train_data_->index().vocab_size,
         " is larger than model.vocab_size ", cfg_.model.vocab_size);
  train_sampler_ = std::make_unique<SequenceSampler>(*train_data_, cfg_.seq_len(), cfg_.train.seed, true);
  if (!cfg_.data.val.empty()) {
    val_data_.emplace(TokenDataset::open(cfg_.data.val));
    if (val_data_->index().vocab_size > cfg_.model.vocab_size)
      fail(ErrorKind::Config, "data.val: dataset vocabulary ", val_data_->index().vocab_size,
           " is larger than model.vocab_size ", cfg_.model.vocab_size);
    val_sampler_ = std::make_unique<SequenceSampler>(*val_data_, cfg_.seq_len(), cfg_.train.seed, false);
  }

  // Size every arena by running the carving code against measuring arenas.
  Arena mp = Arena::measuring("parameters"), mg = Arena::measuring("gradients");
  Arena ms = Arena::measuring("optimizer state"), ma = Arena::measuring("activations");
  model_->layout_parameters(mp, mg);
  opt_->layout_state(ms);
  model_->layout_activations(ma);
  const int64_t n = model_->num_parameters();
  const std::string per = count_str(double(n)) + " x " + dtype_name(opts_.dtype);
  plan_.add("parameters", mp.used(), per);
  plan_.add("gradients", mg.used(), per);
  plan_.add("optimizer state", ms.used(), "AdamW m and v, " + per + " each");
  plan_.add("activations", ma.used(),
            str_cat("micro_batch ", batch.micro_batch, " x seq_len ", batch.seq_len, " x ", batch.activation_slots,
                    " slot(s)"));
  const size_t io_bytes = 2 * size_t(batch.micro_batch) * batch.seq_len * 4 + 2 * Arena::kAlignment;
  plan_.add("input batch", io_bytes, "tokens and targets, int32");
  if (opts_.print) std::fprintf(stderr, "%s", plan_.table("memory plan (rank 0):").c_str());
  plan_.check_limit(size_t(cfg_.memory.limit_gb * double(1ull << 30)), "memory.limit_gb");

  params_ = Arena("parameters", mp.used());
  grads_ = Arena("gradients", mg.used());
  opt_state_ = Arena("optimizer state", ms.used());
  acts_ = Arena("activations", ma.used());
  io_ = Arena("input batch", io_bytes);
  model_->layout_parameters(params_, grads_);
  opt_->layout_state(opt_state_);
  model_->layout_activations(acts_);
  tokens_ = io_.alloc({batch.micro_batch, batch.seq_len}, DType::I32, "tokens");
  targets_ = io_.alloc({batch.micro_batch, batch.seq_len}, DType::I32, "targets");
  model_->init_parameters(cfg_.train.seed);

  if (opts_.peak) peak_ = *opts_.peak;
  else if (cfg_.metrics.peak_tflops > 0) peak_ = {cfg_.metrics.peak_tflops * 1e12, "config metrics.peak_tflops"};
  else peak_ = {measure_sgemm_flops(), "measured sgemm"};
}

double Trainer::accumulate_gradients(int step, StepMetrics& m) {
  const int micro = cfg_.microbatches();
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  // d(mean loss of the global batch) / d(per-token loss): every microbatch has B*T tokens.
  const double dloss = 1.0 / (double(B) * T * micro * cfg_.parallel.dp);
  double loss_sum = 0;
  for (int mb = 0; mb < micro; ++mb) {
    Stopwatch data;
    for (int b = 0; b < B; ++b) {
      int64_t k = int64_t(mb) * B + b;  // this rank's k-th sequence of the global batch
      train_sampler_->fill(SequenceSampler::global_index(step, cfg_.train.global_batch, k),
                           tokens_.data<int32_t>() + int64_t(b) * T, targets_.data<int32_t>() + int64_t(b) * T);
    }
    m.data_wait_ms += data.ms();
    Stopwatch fw;
    loss_sum += model_->forward(ctx_, 0, tokens_, targets_, dloss);
    m.forward_ms += fw.ms();
    Stopwatch bw;
    model_->backward(ctx_, 0, tokens_);
    m.backward_ms += bw.ms();
  }
  return loss_sum / micro;
}

double Trainer::evaluate() {
  XR_CHECK(val_sampler_, "evaluate() without data.val");
  const int B = cfg_.train.micro_batch, T = cfg_.seq_len();
  const int64_t n = std::min<int64_t>(cfg_.train.eval_batches, std::max<int64_t>(1, val_sampler_->samples_per_epoch() / B));
  double sum = 0;
  for (int64_t mb = 0; mb < n; ++mb) {
    for (int b = 0; b < B; ++b)
      val_sampler_->fill(mb * B + b, tokens_.data<int32_t>() + int64_t(b) * T, targets_.data<int32_t>() + int64_t(b) * T);
    sum += model_->forward(ctx_, 0, tokens_, targets_, 0.0);
  }
  return sum / double(n);
}

TrainResult Trainer::run() {
  TrainResult result;
  MetricsLog log(cfg_.metrics.jsonl, peak_);
  ProgressLine progress(cfg_.train.steps, cfg_.metrics.log_every);
  const double tokens_per_step = double(cfg_.train.global_batch) * cfg_.seq_len();
  const double flops_per_step = model_->flops_per_token() * tokens_per_step;
  if (opts_.print)
    std::fprintf(stderr, "model: %s parameters, %d layers, d_model %d, %d heads; %d steps of %.0f tokens; peak %.1f GFLOP/s (%s)\n",
                 count_str(double(model_->num_parameters())).c_str(), cfg_.model.n_layer, cfg_.model.d_model,
                 cfg_.model.n_head, cfg_.train.steps, tokens_per_step, peak_.flops / 1e9, peak_.source.c_str());
  Stopwatch elapsed;
  for (int step = 0; step < cfg_.train.steps; ++step) {
    StepMetrics m;
    m.step = step + 1;
    Stopwatch sw;
    opt_->zero_grads(ctx_);
    m.loss = accumulate_gradients(step, m);
    Stopwatch ow;
    m.grad_norm = opt_->grad_norm(ctx_);
    m.lr = lr_at(cfg_.train, step);
    opt_->step(ctx_, step + 1, m.lr, clip_scale(cfg_.train.grad_clip, m.grad_norm));
    m.optimizer_ms = ow.ms();
    m.step_ms = sw.ms();
    m.tokens_per_s = tokens_per_step / (m.step_ms / 1e3);
    m.mfu = flops_per_step / (m.step_ms / 1e3) / peak_.flops;
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
