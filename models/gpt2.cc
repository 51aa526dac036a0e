#include "models/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/clock.h"
#include "core/device_memory.h"
#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"

namespace xirang {

int64_t ShardSpec::global_index(const Shape& local, int64_t i) const {
  if (replicated()) return i;
  auto map = [&](int64_t x) {
    const int64_t lb = local[dim] / blocks;  // local rows (or columns) per block
    return (x / lb) * lb * parts + index * lb + x % lb;
  };
  if (local.rank() == 1) return map(i);
  const int64_t r = i / local[1], c = i % local[1];
  return dim == 0 ? map(r) * global[1] + c : r * global[1] + map(c);
}

GPT2::GPT2(const GPT2Shape& shape, const GPT2Stage& stage, DType dtype, const GPT2Batch& batch,
           const GPT2Parallel& parallel)
    : shape_(shape),
      stage_(stage),
      dtype_(dtype),
      wide_dtype_(dtype == DType::BF16 || dtype == DType::F16 ? DType::F32 : dtype),
      batch_(batch),
      par_(parallel) {
  XR_CHECK(is_float(dtype), "GPT2: model dtype ", dtype_name(dtype), " is not a float type");
  const int64_t C = shape.d_model;
  if (par_.tp) {
    tp_size_ = par_.tp->size();
    tp_rank_ = par_.tp->rank();
  }
  const int P = tp_size_;
  // In a group of one there is nothing to split: run the plain single-rank path.
  if (P == 1) par_.sequence_parallel = false;
  XR_CHECK(C % shape.n_head == 0, "d_model ", C, " % n_head ", shape.n_head);
  XR_CHECK(shape.n_head % P == 0 && shape.padded_vocab % P == 0, "tp ", P, " must divide n_head and the padded vocab");
  XR_CHECK(0 <= stage.first_layer && stage.first_layer <= stage.end_layer && stage.end_layer <= shape.n_layer,
           "stage layers [", stage.first_layer, ", ", stage.end_layer, ")");
  XR_CHECK(batch.seq_len <= shape.max_seq_len, "seq_len ", batch.seq_len, " > max_seq_len ", shape.max_seq_len);
  XR_CHECK(shape.padded_vocab >= shape.vocab_size, "padded vocab");
  rows_ = int64_t(batch.micro_batch) * batch.seq_len;
  local_rows_ = par_.sequence_parallel ? rows_ / P : rows_;
  XR_CHECK(!par_.sequence_parallel || rows_ % P == 0, "sequence parallelism needs B*T ", rows_, " divisible by tp ", P);

  const int64_t Cp = C / P, Fp = 4 * C / P, Vp = shape.padded_vocab / P;
  auto rep = [&](Shape g) { return ShardSpec{g, -1, 1, 0, 1}; };
  auto split = [&](Shape g, int dim, int blocks = 1) { return ShardSpec{g, dim, P, tp_rank_, blocks}; };
  // Pointers into params_ are kept below, so its storage must never move.
  params_.reserve(4 + 12 * size_t(stage.end_layer - stage.first_layer));
  // The tied token embedding is held by the first stage (input) and the last (head).
  if (stage.has_embedding || stage.has_head) {
    wte_ = add_param("wte.weight", {Vp, C}, split({shape.padded_vocab, C}, 0), true, -1);
    wte_->tied_copy = !stage.has_embedding;
  }
  if (stage.has_embedding) wpe_ = add_param("wpe.weight", {shape.max_seq_len, C}, rep({shape.max_seq_len, C}), true, -1);
  for (int l = stage.first_layer; l < stage.end_layer; ++l) {
    std::string p = "h." + std::to_string(l) + ".";
    BlockParams b;
    b.ln1_w = add_param(p + "ln_1.weight", {C}, rep({C}), false, l);
    b.ln1_b = add_param(p + "ln_1.bias", {C}, rep({C}), false, l);
    b.qkv_w = add_param(p + "attn.c_attn.weight", {3 * Cp, C}, split({3 * C, C}, 0, 3), true, l);
    b.qkv_b = add_param(p + "attn.c_attn.bias", {3 * Cp}, split({3 * C}, 0, 3), false, l);
    b.attn_w = add_param(p + "attn.c_proj.weight", {C, Cp}, split({C, C}, 1), true, l);
    b.attn_b = add_param(p + "attn.c_proj.bias", {C}, rep({C}), false, l);
    b.ln2_w = add_param(p + "ln_2.weight", {C}, rep({C}), false, l);
    b.ln2_b = add_param(p + "ln_2.bias", {C}, rep({C}), false, l);
    b.fc_w = add_param(p + "mlp.c_fc.weight", {Fp, C}, split({4 * C, C}, 0), true, l);
    b.fc_b = add_param(p + "mlp.c_fc.bias", {Fp}, split({4 * C}, 0), false, l);
    b.proj_w = add_param(p + "mlp.c_proj.weight", {C, Fp}, split({C, 4 * C}, 1), true, l);
    b.proj_b = add_param(p + "mlp.c_proj.bias", {C}, rep({C}), false, l);
    blocks_.push_back(b);
  }
  if (stage.has_head) {
    lnf_w_ = add_param("ln_f.weight", {C}, rep({C}), false, shape.n_layer);
    lnf_b_ = add_param("ln_f.bias", {C}, rep({C}), false, shape.n_layer);
  }
}

Parameter* GPT2::add_param(const std::string& name, Shape local, ShardSpec shard, bool decay, int layer) {
  XR_CHECK(params_.size() < params_.capacity(), "parameter list outgrew its reservation");
  params_.push_back({name, Tensor(nullptr, local, dtype_), Tensor(nullptr, local, wide_dtype_), decay, layer, shard});
  return &params_.back();
}

void GPT2::layout_parameters(Arena& params, Arena& grads) {
  if (wide_dtype_ == dtype_) {
    for (auto& p : params_) {
      p.value = params.alloc(p.value.shape(), dtype_, p.name);
      p.grad = grads.alloc(p.grad.shape(), wide_dtype_, p.name + " (grad)");
    }
    return;
  }
  // Both arenas advance by the same number of elements per parameter.
  const int64_t block = int64_t(Arena::kAlignment / dtype_size(dtype_));
  for (auto& p : params_) {
    const Shape shape = p.value.shape();
    const int64_t padded = (shape.numel() + block - 1) / block * block;
    p.value = params.alloc({padded}, dtype_, p.name).flat_range(0, shape.numel()).view(shape);
    p.grad = grads.alloc({padded}, wide_dtype_, p.name + " (grad)").flat_range(0, shape.numel()).view(shape);
  }
}

void GPT2::layout_activations(Arena& acts) {
  const int64_t B = batch_.micro_batch, T = batch_.seq_len, C = shape_.d_model, P = tp_size_;
  const int64_t N = rows_, R = local_rows_, Hp = shape_.n_head / P, Cp = C / P;
  auto A = [&](Shape s, const char* what) { return acts.alloc(s, dtype_, what); };
  auto W = [&](Shape s, const char* what) { return acts.alloc(s, wide_dtype_, what); };  // statistics, losses
  slots_.assign(size_t(batch_.activation_slots), {});
  for (auto& s : slots_) {
    s.input = A({R, C}, "stage input");
    s.blocks.resize(blocks_.size());
    for (auto& a : s.blocks) {
      a.ln1 = A({R, C}, "ln_1 output");
      a.ln1_mean = W({R}, "ln_1 mean");
      a.ln1_rstd = W({R}, "ln_1 rstd");
      a.qkv = A({B, T, 3 * Cp}, "qkv");
      a.lse = W({B, Hp, T}, "attention log-sum-exp");
      a.atty = A({B, T, Cp}, "attention output");
      a.res2 = A({R, C}, "residual 2");
      a.ln2 = A({R, C}, "ln_2 output");
      a.ln2_mean = W({R}, "ln_2 mean");
      a.ln2_rstd = W({R}, "ln_2 rstd");
      a.fch = A({N, 4 * Cp}, "mlp hidden");
      a.fch_gelu = A({N, 4 * Cp}, "mlp gelu");
      a.res3 = A({R, C}, "block output");
    }
    if (stage_.has_head) {
      s.lnf = A({R, C}, "ln_f output");
      s.lnf_mean = W({R}, "ln_f mean");
      s.lnf_rstd = W({R}, "ln_f rstd");
      s.logits = A({N, shape_.padded_vocab / P}, "logits");
      s.losses = W({N}, "losses");
    }
  }
  partial_ = A({N, C}, "row-parallel partial sums");
  if (par_.sequence_parallel) {
    ln_full_ = A({N, C}, "gathered LayerNorm output");
    d_full_ = A({N, C}, "gathered residual gradient");
  }
  d_res_ = A({R, C}, "residual gradient");
  d_c_ = A({R, C}, "LayerNorm output gradient");
  d_big_ = A({N, 4 * Cp}, "backward scratch (4C/P)");
  if (stage_.has_head && P > 1) {
    ce_max_ = W({N}, "softmax row max");
    ce_sums_ = W({N, 2}, "softmax sums");
  }
  if (stage_.has_head) loss_sum_ = acts.alloc({1}, DType::F64, "loss sum");
  loss_pending_ = false;
}

void GPT2::init_parameters(uint64_t seed) {
  const double std_w = 0.02;
  // Residual projections are scaled down by depth (GPT-2 paper, section 2.3).
  const double std_proj = 0.02 / std::sqrt(2.0 * shape_.n_layer);
  for (auto& p : params_) {
    const uint64_t stream = name_stream(p.name);
    const int64_t n = p.value.numel();
    const std::string& nm = p.name;
    auto ends_with = [&](const char* suf) {
      size_t k = std::strlen(suf);
      return nm.size() >= k && nm.compare(nm.size() - k, k, suf) == 0;
    };
    enum { Zero, One, Normal } kind = Normal;
    double sd = std_w;
    if (ends_with(".bias")) kind = Zero;
    else if (ends_with("ln_1.weight") || ends_with("ln_2.weight") || ends_with("ln_f.weight")) kind = One;
    else if (ends_with("c_proj.weight")) sd = std_proj;
    else if (nm == "wpe.weight") sd = 0.01;
    // Padding rows of the token embedding stay zero: no token selects them and their logits are ignored.
    const int64_t limit = nm == "wte.weight" ? int64_t(shape_.vocab_size) * shape_.d_model : p.shard.global.numel();
    const Shape local = p.value.shape();
    // Device parameters are filled on the host and copied over.
    std::vector<char> staging;
    Tensor dst = p.value;
    if (dst.device() != Device::CPU) {
      staging.resize(dst.bytes());
      dst = Tensor(staging.data(), local, dtype_);
    }
    auto value_at = [&](int64_t i) {
      const int64_t g = p.shard.global_index(local, i);
      return kind == Zero ? 0.0 : kind == One ? 1.0 : (g < limit ? sd * rng_normal(seed, stream, uint64_t(g)) : 0.0);
    };
    switch (dtype_) {
      case DType::F32: {
        float* v = dst.data<float>();
        for (int64_t i = 0; i < n; ++i) v[i] = float(value_at(i));
        break;
      }
      case DType::F64: {
        double* v = dst.data<double>();
        for (int64_t i = 0; i < n; ++i) v[i] = value_at(i);
        break;
      }
      case DType::BF16: {
        bf16* v = dst.data<bf16>();
        for (int64_t i = 0; i < n; ++i) v[i] = float_to_bf16(float(value_at(i)));
        break;
      }
      case DType::F16: {
        f16* v = dst.data<f16>();
        for (int64_t i = 0; i < n; ++i) v[i] = float_to_f16(float(value_at(i)));
        break;
      }
      default: fail(ErrorKind::Internal, "init_parameters: unsupported model dtype ", dtype_name(dtype_));
    }
    if (dst.raw() != p.value.raw()) copy_tensor(p.value, dst);
  }
}

// ---- tensor-parallel communication (each a no-op in a group of one)

void GPT2::tp_all_reduce(Tensor t, ReduceOp op) {
  if (tp_size_ == 1) return;
  Stopwatch sw;
  par_.tp->all_reduce_async(t, op)->join(stream_);
  tp_comm_ms_ += sw.ms();
}

Tensor GPT2::norm_to_full(const KernelContext& ctx, Tensor out, Tensor mean, Tensor rstd, const Tensor& x,
                          const Parameter& w, const Parameter& b) {
  layernorm_forward(ctx, out, mean, rstd, x, w.value, b.value);
  return gathered(out);  // all-gather forward, reduce-scatter backward
}

Tensor GPT2::gathered(const Tensor& local) {
  if (!par_.sequence_parallel) return local;
  Stopwatch sw;
  par_.tp->all_gather_async(local, ln_full_)->join(stream_);
  tp_comm_ms_ += sw.ms();
  return ln_full_;
}

void GPT2::reduce_rows(Tensor partial, Tensor out) {
  if (tp_size_ == 1) return;
  Stopwatch sw;
  WorkPtr w = par_.sequence_parallel ? par_.tp->reduce_scatter_async(partial, out, ReduceOp::Sum)
                                     : par_.tp->all_reduce_async(partial, ReduceOp::Sum);
  w->join(stream_);
  tp_comm_ms_ += sw.ms();
}

Tensor GPT2::full_rows(Tensor local) {
  if (!par_.sequence_parallel) return local;
  Stopwatch sw;
  par_.tp->all_gather_async(local, d_full_)->join(stream_);
  tp_comm_ms_ += sw.ms();
  return d_full_;
}

void GPT2::reduce_partial_norm_grads(const Parameter& w, const Parameter& b) {
  // Under sequence parallelism each rank normalised only its rows.
  if (!par_.sequence_parallel) return;
  tp_all_reduce(w.grad, ReduceOp::Sum);
  tp_all_reduce(b.grad, ReduceOp::Sum);
}

double GPT2::take_tp_comm_ms() {
  double t = tp_comm_ms_;
  tp_comm_ms_ = 0;
  return t;
}

// ---- forward

void GPT2::block_forward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a) {
  const BlockParams& p = blocks_[size_t(l)];
  const bool split = tp_size_ > 1;
  // Row-parallel outputs land in `partial` and are reduced into the local
  // rows; without a split the product writes the residual buffer directly.
  auto row_parallel = [&](Tensor out, const Tensor& in, const Parameter& w, const Parameter& bias, const Tensor& skip) {
    const bool via_partial = split && par_.sequence_parallel;
    Tensor dst = via_partial ? partial_ : out;
    linear_forward(ctx, dst, in, w.value, Tensor());
    if (via_partial) reduce_rows(partial_, out);
    else reduce_rows(out, out);
    add_bias(ctx, out, bias.value);  // once, after the reduction
    add(ctx, out, out, skip);
  };
  const Tensor ln1 = norm_to_full(ctx, a.ln1, a.ln1_mean, a.ln1_rstd, x, *p.ln1_w, *p.ln1_b);
  linear_forward(ctx, a.qkv.flat2d(), ln1, p.qkv_w->value, p.qkv_b->value);
  flash_attention_forward(ctx, a.atty, a.lse, a.qkv, shape_.n_head / tp_size_);
  Tensor ln2 = a.ln2;
  if (split) {
    row_parallel(a.res2, a.atty.flat2d(), *p.attn_w, *p.attn_b, x);
    ln2 = norm_to_full(ctx, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, *p.ln2_w, *p.ln2_b);
  } else {
    // One rank: the bias rides on the product, the residual add on the LayerNorm.
    linear_forward(ctx, a.res2, a.atty.flat2d(), p.attn_w->value, p.attn_b->value);
    residual_layernorm_forward(ctx, a.res2, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, x, p.ln2_w->value, p.ln2_b->value);
  }
  linear_gelu_forward(ctx, a.fch_gelu, a.fch, ln2, p.fc_w->value, p.fc_b->value);
  row_parallel(a.res3, a.fch_gelu, *p.proj_w, *p.proj_b, a.res2);
}

void GPT2::head_loss(const KernelContext& ctx, SlotActs& s, const Tensor& targets, double dloss) {
  const Tensor tg = targets.view({rows_});
  Tensor dlogits = dloss > 0 ? s.logits : Tensor();
  if (tp_size_ == 1) {
    cross_entropy_forward_backward(ctx, s.losses, dlogits, s.logits, tg, shape_.vocab_size, dloss);
  } else {
    // Vocabulary-parallel softmax: only (N) and (N, 2) statistics cross ranks.
    const int64_t vb = int64_t(tp_rank_) * (shape_.padded_vocab / tp_size_);
    cross_entropy_shard_max(ctx, ce_max_, s.logits, vb, shape_.vocab_size);
    tp_all_reduce(ce_max_, ReduceOp::Max);
    cross_entropy_shard_sums(ctx, ce_sums_, s.logits, tg, ce_max_, vb, shape_.vocab_size);
    tp_all_reduce(ce_sums_, ReduceOp::Sum);
    cross_entropy_shard_finish(ctx, s.losses, dlogits, s.logits, tg, ce_max_, ce_sums_, vb, shape_.vocab_size, dloss);
  }
  // The microbatch's mean loss joins the step's sum on the device: the host
  // reads it once, in take_loss().
  if (!loss_pending_) zero(ctx, loss_sum_);
  mean_accumulate(ctx, loss_sum_, s.losses);
  loss_pending_ = true;
}

double GPT2::take_loss(const KernelContext& ctx) {
  if (!stage_.has_head || !loss_pending_) return 0.0;
  double sum = 0;
  copy_bytes(&sum, Device::CPU, loss_sum_.raw(), loss_sum_.device(), sizeof(double), ctx.cuda_stream, true);
  loss_pending_ = false;
  return sum;
}

void GPT2::forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets, double dloss) {
  stream_ = ctx.cuda_stream;
  SlotActs& s = slots_.at(size_t(slot));
  const int64_t T = batch_.seq_len;
  if (stage_.has_embedding) {
    check_shape("GPT2::forward", "tokens", tokens, {batch_.micro_batch, batch_.seq_len});
    const int64_t vb = int64_t(tp_rank_) * (shape_.padded_vocab / tp_size_);
    const Tensor tk = tokens.view({rows_});
    // Vocabulary-parallel lookup: rows of tokens another rank holds are zero here.
    Tensor dst = par_.sequence_parallel ? partial_ : s.input;
    embedding_lookup(ctx, dst, tk, wte_->value, vb, shape_.vocab_size);
    reduce_rows(dst, s.input);
    add_positions(ctx, s.input, wpe_->value, T, par_.sequence_parallel ? int64_t(tp_rank_) * local_rows_ : 0);
  }
  const Tensor* x = &s.input;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    block_forward(ctx, int(l), *x, s.blocks[l]);
    x = &s.blocks[l].res3;
  }
  if (!stage_.has_head) return;
  check_shape("GPT2::forward", "targets", targets, {batch_.micro_batch, batch_.seq_len});
  const Tensor lnf = norm_to_full(ctx, s.lnf, s.lnf_mean, s.lnf_rstd, *x, *lnf_w_, *lnf_b_);
  linear_forward(ctx, s.logits, lnf, wte_->value, Tensor());
  head_loss(ctx, s, targets, dloss);
}

// ---- backward: the mirror of forward

// On entry d_res_ holds d(block output) for the local rows; on exit d(block
// input). Residual adds need no op: the gradient passes through d_res_ and
// the LayerNorm backward passes accumulate into it.
void GPT2::block_backward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a, GradPhase phase) {
  BlockParams& p = blocks_[size_t(l)];
  const int64_t N = rows_, Cp = shape_.d_model / tp_size_;
  Tensor d4 = d_big_;                                                     // (N, 4C/P)
  Tensor datty = d_big_.flat().flat_range(0, N * Cp).view({N, Cp});       // (N, C/P)
  Tensor dqkv = d_big_.flat().flat_range(N * Cp, N * 4 * Cp).view(a.qkv.shape());  // (B, T, 3C/P)
  // The column-parallel input gradient: partial sums over this rank's heads
  // or hidden units, reduced into the local rows (all-reduce, or
  // reduce-scatter under sequence parallelism).
  auto column_input_grad = [&]() -> Tensor {
    if (tp_size_ == 1) return partial_;
    reduce_rows(partial_, par_.sequence_parallel ? d_c_ : partial_);
    return par_.sequence_parallel ? d_c_ : partial_;
  };

  Tensor dy = full_rows(d_res_);
  linear_backward(ctx, d4, p.proj_w->grad, p.proj_b->grad, dy, a.fch_gelu, p.proj_w->value, GradMode::Overwrite);
  linear_gelu_backward(ctx, partial_, p.fc_w->grad, p.fc_b->grad, d4, d4, a.fch, gathered(a.ln2), p.fc_w->value,
                       GradMode::Overwrite);
  layernorm_backward(ctx, d_res_, p.ln2_w->grad, p.ln2_b->grad, column_input_grad(), a.res2, p.ln2_w->value,
                     a.ln2_mean, a.ln2_rstd, GradMode::Accumulate);

  dy = full_rows(d_res_);
  linear_backward(ctx, datty, p.attn_w->grad, p.attn_b->grad, dy, a.atty.flat2d(), p.attn_w->value,
                  GradMode::Overwrite);
  flash_attention_backward(ctx, dqkv, datty.view(a.atty.shape()), a.qkv, a.atty, a.lse, shape_.n_head / tp_size_);
  linear_backward(ctx, partial_, p.qkv_w->grad, p.qkv_b->grad, dqkv.flat2d(), gathered(a.ln1), p.qkv_w->value,
                  GradMode::Overwrite);
  layernorm_backward(ctx, d_res_, p.ln1_w->grad, p.ln1_b->grad, column_input_grad(), x, p.ln1_w->value, a.ln1_mean,
                     a.ln1_rstd, GradMode::Accumulate);
  if (phase == GradPhase::Final) {
    reduce_partial_norm_grads(*p.ln1_w, *p.ln1_b);
    reduce_partial_norm_grads(*p.ln2_w, *p.ln2_b);
  }
}

Tensor GPT2::stage_output(int slot) {
  SlotActs& s = slots_.at(size_t(slot));
  return blocks_.empty() ? s.input : s.blocks.back().res3;
}

void GPT2::backward(const KernelContext& ctx, int slot, const Tensor& tokens, GradPhase phase,
                    const Tensor& output_grad) {
  stream_ = ctx.cuda_stream;
  SlotActs& s = slots_.at(size_t(slot));
  const bool final_pass = phase == GradPhase::Final;
  auto ready = [&](int layer) {
    if (final_pass && grad_ready_) grad_ready_(layer);
  };
  if (stage_.has_head) {
    // The training forward left dlogits in s.logits.
    const Tensor& last = blocks_.empty() ? s.input : s.blocks.back().res3;
    linear_backward(ctx, partial_, wte_->grad, Tensor(), s.logits, gathered(s.lnf), wte_->value, GradMode::Overwrite);
    Tensor dlnf = partial_;
    if (tp_size_ > 1) {
      reduce_rows(partial_, par_.sequence_parallel ? d_c_ : partial_);
      if (par_.sequence_parallel) dlnf = d_c_;
    }
    zero(ctx, d_res_);
    layernorm_backward(ctx, d_res_, lnf_w_->grad, lnf_b_->grad, dlnf, last, lnf_w_->value, s.lnf_mean, s.lnf_rstd,
                       GradMode::Accumulate);
    if (final_pass) reduce_partial_norm_grads(*lnf_w_, *lnf_b_);
    ready(shape_.n_layer);
  } else {
    check_shape("GPT2::backward", "output_grad", output_grad, d_res_.shape());
    copy_tensor(d_res_, output_grad, ctx.cuda_stream, false);  // in stream order on a device
  }
  for (int l = int(blocks_.size()) - 1; l >= 0; --l) {
    const Tensor& x = l == 0 ? s.input : s.blocks[size_t(l - 1)].res3;
    block_backward(ctx, l, x, s.blocks[size_t(l)], phase);
    ready(stage_.first_layer + l);
  }
  if (stage_.has_embedding) {
    // Every rank needs the gradient of all N rows: its table shard serves tokens from any row.
    Tensor dy = full_rows(d_res_);
    const int64_t vb = int64_t(tp_rank_) * (shape_.padded_vocab / tp_size_);
    embedding_lookup_backward(ctx, wte_->grad, dy, tokens.view({rows_}), vb, shape_.vocab_size);
    add_positions_backward(ctx, wpe_->grad, dy, batch_.seq_len, 0);
    ready(-1);
  }
}

int64_t GPT2::num_parameters() const {
  int64_t n = 0;
  for (auto& p : params_) n += p.value.numel();
  return n;
}

int64_t GPT2::num_global_parameters() const {
  int64_t n = 0;
  for (auto& p : params_) n += p.shard.global.numel();
  return n;
}

double GPT2::flops_per_token() const {
  const double L = shape_.n_layer, C = shape_.d_model, T = batch_.seq_len;
  const double matrix_params = L * 12.0 * C * C + double(shape_.padded_vocab) * C;
  return 6.0 * matrix_params + 12.0 * L * C * T;
}

}  // namespace xirang
