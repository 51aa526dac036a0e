#include "models/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"

namespace xirang {

GPT2::GPT2(const GPT2Shape& shape, const GPT2Stage& stage, DType dtype, const GPT2Batch& batch)
    : shape_(shape), stage_(stage), dtype_(dtype), batch_(batch) {
  const int64_t C = shape.d_model;
  XR_CHECK(C % shape.n_head == 0, "d_model ", C, " % n_head ", shape.n_head);
  XR_CHECK(0 <= stage.first_layer && stage.first_layer <= stage.end_layer && stage.end_layer <= shape.n_layer,
           "stage layers [", stage.first_layer, ", ", stage.end_layer, ")");
  XR_CHECK(batch.seq_len <= shape.max_seq_len, "seq_len ", batch.seq_len, " > max_seq_len ", shape.max_seq_len);
  XR_CHECK(shape.padded_vocab >= shape.vocab_size, "padded vocab");
  // Pointers into params_ are kept below, so its storage must never move.
  params_.reserve(4 + 12 * size_t(stage.end_layer - stage.first_layer));
  // The tied token embedding is held by the first stage (input) and the last (head).
  if (stage.has_embedding || stage.has_head) wte_ = add_param("wte.weight", {shape.padded_vocab, C}, true, -1);
  if (stage.has_embedding) wpe_ = add_param("wpe.weight", {shape.max_seq_len, C}, true, -1);
  for (int l = stage.first_layer; l < stage.end_layer; ++l) {
    std::string p = "h." + std::to_string(l) + ".";
    BlockParams b;
    b.ln1_w = add_param(p + "ln_1.weight", {C}, false, l);
    b.ln1_b = add_param(p + "ln_1.bias", {C}, false, l);
    b.qkv_w = add_param(p + "attn.c_attn.weight", {3 * C, C}, true, l);
    b.qkv_b = add_param(p + "attn.c_attn.bias", {3 * C}, false, l);
    b.attn_w = add_param(p + "attn.c_proj.weight", {C, C}, true, l);
    b.attn_b = add_param(p + "attn.c_proj.bias", {C}, false, l);
    b.ln2_w = add_param(p + "ln_2.weight", {C}, false, l);
    b.ln2_b = add_param(p + "ln_2.bias", {C}, false, l);
    b.fc_w = add_param(p + "mlp.c_fc.weight", {4 * C, C}, true, l);
    b.fc_b = add_param(p + "mlp.c_fc.bias", {4 * C}, false, l);
    b.proj_w = add_param(p + "mlp.c_proj.weight", {C, 4 * C}, true, l);
    b.proj_b = add_param(p + "mlp.c_proj.bias", {C}, false, l);
    blocks_.push_back(b);
  }
  if (stage.has_head) {
    lnf_w_ = add_param("ln_f.weight", {C}, false, shape.n_layer);
    lnf_b_ = add_param("ln_f.bias", {C}, false, shape.n_layer);
  }
}

Parameter* GPT2::add_param(const std::string& name, Shape shape, bool decay, int layer) {
  XR_CHECK(params_.size() < params_.capacity(), "parameter list outgrew its reservation");
  params_.push_back({name, Tensor(nullptr, shape, dtype_), Tensor(nullptr, shape, dtype_), decay, layer});
  return &params_.back();
}

void GPT2::layout_parameters(Arena& params, Arena& grads) {
  for (auto& p : params_) {
    p.value = params.alloc(p.value.shape(), dtype_, p.name);
    p.grad = grads.alloc(p.grad.shape(), dtype_, p.name + " (grad)");
  }
}

void GPT2::layout_activations(Arena& acts) {
  const int64_t B = batch_.micro_batch, T = batch_.seq_len, C = shape_.d_model, H = shape_.n_head;
  auto A = [&](Shape s, const char* what) { return acts.alloc(s, dtype_, what); };
  slots_.assign(size_t(batch_.activation_slots), {});
  for (auto& s : slots_) {
    s.input = A({B, T, C}, "stage input");
    s.blocks.resize(blocks_.size());
    for (auto& a : s.blocks) {
      a.ln1 = A({B, T, C}, "ln_1 output");
      a.ln1_mean = A({B, T}, "ln_1 mean");
      a.ln1_rstd = A({B, T}, "ln_1 rstd");
      a.qkv = A({B, T, 3 * C}, "qkv");
      a.probs = A({B, H, T, T}, "attention probabilities");
      a.atty = A({B, T, C}, "attention output");
      a.res2 = A({B, T, C}, "residual 2");
      a.ln2 = A({B, T, C}, "ln_2 output");
      a.ln2_mean = A({B, T}, "ln_2 mean");
      a.ln2_rstd = A({B, T}, "ln_2 rstd");
      a.fch = A({B, T, 4 * C}, "mlp hidden");
      a.fch_gelu = A({B, T, 4 * C}, "mlp gelu");
      a.res3 = A({B, T, C}, "block output");
    }
    if (stage_.has_head) {
      s.lnf = A({B, T, C}, "ln_f output");
      s.lnf_mean = A({B, T}, "ln_f mean");
      s.lnf_rstd = A({B, T}, "ln_f rstd");
      s.logits = A({B, T, shape_.padded_vocab}, "logits");
      s.losses = A({B, T}, "losses");
    }
  }
  d_res_ = A({B, T, C}, "residual gradient");
  d_c_ = A({B, T, C}, "backward scratch");
  d_big_ = A({B, T, 4 * C}, "backward scratch (4C)");
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
    const int64_t limit = nm == "wte.weight" ? int64_t(shape_.vocab_size) * shape_.d_model : n;
    auto fill = [&](auto* v) {
      using T = std::remove_pointer_t<decltype(v)>;
      for (int64_t i = 0; i < n; ++i) {
        double x = kind == Zero ? 0.0 : kind == One ? 1.0 : (i < limit ? sd * rng_normal(seed, stream, uint64_t(i)) : 0.0);
        v[i] = T(x);
      }
    };
    if (dtype_ == DType::F32) fill(p.value.data<float>());
    else if (dtype_ == DType::F64) fill(p.value.data<double>());
    else fail(ErrorKind::Internal, "init_parameters: unsupported model dtype ", dtype_name(dtype_));
  }
}

void GPT2::block_forward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a) {
  const BlockParams& p = blocks_[size_t(l)];
  layernorm_forward(ctx, a.ln1, a.ln1_mean, a.ln1_rstd, x, p.ln1_w->value, p.ln1_b->value);
  linear_forward(ctx, a.qkv.flat2d(), a.ln1.flat2d(), p.qkv_w->value, p.qkv_b->value);
  attention_forward(ctx, a.atty, a.probs, a.qkv, shape_.n_head);
  linear_forward(ctx, a.res2.flat2d(), a.atty.flat2d(), p.attn_w->value, p.attn_b->value);
  add(ctx, a.res2, a.res2, x);
  layernorm_forward(ctx, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p.ln2_w->value, p.ln2_b->value);
  linear_forward(ctx, a.fch.flat2d(), a.ln2.flat2d(), p.fc_w->value, p.fc_b->value);
  gelu_forward(ctx, a.fch_gelu, a.fch);
  linear_forward(ctx, a.res3.flat2d(), a.fch_gelu.flat2d(), p.proj_w->value, p.proj_b->value);
  add(ctx, a.res3, a.res3, a.res2);
}

// The mirror of block_forward. On entry dres holds d(block output); on exit
// d(block input). Residual adds need no op: the gradient passes through dres
// and the LayerNorm backward passes accumulate into it.
void GPT2::block_backward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a, Tensor dres) {
  BlockParams& p = blocks_[size_t(l)];
  Tensor d4 = d_big_.flat2d();           // (B*T, 4C)
  Tensor dc = d_c_.flat2d();             // (B*T, C)
  Tensor dr = dres.flat2d();
  linear_backward(ctx, d4, p.proj_w->grad, p.proj_b->grad, dr, a.fch_gelu.flat2d(), p.proj_w->value, GradMode::Overwrite);
  gelu_backward(ctx, d_big_, d_big_, a.fch);
  linear_backward(ctx, dc, p.fc_w->grad, p.fc_b->grad, d4, a.ln2.flat2d(), p.fc_w->value, GradMode::Overwrite);
  layernorm_backward(ctx, dres, p.ln2_w->grad, p.ln2_b->grad, d_c_, a.res2, p.ln2_w->value, a.ln2_mean, a.ln2_rstd,
                     GradMode::Accumulate);
  linear_backward(ctx, dc, p.attn_w->grad, p.attn_b->grad, dr, a.atty.flat2d(), p.attn_w->value, GradMode::Overwrite);
  const Shape qkv_shape = a.qkv.shape();
  Tensor dqkv = d_big_.flat().flat_range(0, qkv_shape.numel()).view(qkv_shape);
  attention_backward(ctx, dqkv, d_c_, a.qkv, a.probs, shape_.n_head);
  linear_backward(ctx, dc, p.qkv_w->grad, p.qkv_b->grad, dqkv.flat2d(), a.ln1.flat2d(), p.qkv_w->value,
                  GradMode::Overwrite);
  layernorm_backward(ctx, dres, p.ln1_w->grad, p.ln1_b->grad, d_c_, x, p.ln1_w->value, a.ln1_mean, a.ln1_rstd,
                     GradMode::Accumulate);
}

double GPT2::forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets, double dloss) {
  SlotActs& s = slots_.at(size_t(slot));
  if (stage_.has_embedding) {
    check_shape("GPT2::forward", "tokens", tokens, {batch_.micro_batch, batch_.seq_len});
    embedding_forward(ctx, s.input, tokens, wte_->value, wpe_->value);
  }
  const Tensor* x = &s.input;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    block_forward(ctx, int(l), *x, s.blocks[l]);
    x = &s.blocks[l].res3;
  }
  if (!stage_.has_head) return 0.0;
  check_shape("GPT2::forward", "targets", targets, {batch_.micro_batch, batch_.seq_len});
  layernorm_forward(ctx, s.lnf, s.lnf_mean, s.lnf_rstd, *x, lnf_w_->value, lnf_b_->value);
  linear_forward(ctx, s.logits.flat2d(), s.lnf.flat2d(), wte_->value, Tensor());
  Tensor dlogits = dloss > 0 ? s.logits : Tensor();
  cross_entropy_forward_backward(ctx, s.losses, dlogits, s.logits, targets, shape_.vocab_size, dloss);
  double sum = 0;
  const int64_t n = s.losses.numel();
  if (dtype_ == DType::F32) {
    const float* pl = s.losses.data<float>();
    for (int64_t i = 0; i < n; ++i) sum += pl[i];
  } else {
    const double* pl = s.losses.data<double>();
    for (int64_t i = 0; i < n; ++i) sum += pl[i];
  }
  return sum / double(n);
}

void GPT2::backward(const KernelContext& ctx, int slot, const Tensor& tokens) {
  SlotActs& s = slots_.at(size_t(slot));
  if (stage_.has_head) {
    // The training forward left dlogits in s.logits.
    const Tensor& last = blocks_.empty() ? s.input : s.blocks.back().res3;
    linear_backward(ctx, d_c_.flat2d(), wte_->grad, Tensor(), s.logits.flat2d(), s.lnf.flat2d(), wte_->value,
                    GradMode::Overwrite);
    zero(ctx, d_res_);
    layernorm_backward(ctx, d_res_, lnf_w_->grad, lnf_b_->grad, d_c_, last, lnf_w_->value, s.lnf_mean, s.lnf_rstd,
                       GradMode::Accumulate);
    if (grad_ready_) grad_ready_(shape_.n_layer);
  }
  for (int l = int(blocks_.size()) - 1; l >= 0; --l) {
    const Tensor& x = l == 0 ? s.input : s.blocks[size_t(l - 1)].res3;
    block_backward(ctx, l, x, s.blocks[size_t(l)], d_res_);
    if (grad_ready_) grad_ready_(stage_.first_layer + l);
  }
  if (stage_.has_embedding) {
    embedding_backward(ctx, wte_->grad, wpe_->grad, d_res_, tokens);
    if (grad_ready_) grad_ready_(-1);
  }
}

int64_t GPT2::num_parameters() const {
  int64_t n = 0;
  for (auto& p : params_) n += p.value.numel();
  return n;
}

double GPT2::flops_per_token() const {
  const double L = shape_.n_layer, C = shape_.d_model, T = batch_.seq_len;
  const double matrix_params = L * 12.0 * C * C + double(shape_.padded_vocab) * C;
  return 6.0 * matrix_params + 12.0 * L * C * T;
}

}  // namespace xirang
