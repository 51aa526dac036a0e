#include "models/llama/llama.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/clock.h"
#include "core/device_memory.h"
#include "core/timeline.h"
#include "kernels/elementwise.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "models/llama/llama_files.h"

namespace xirang {

int llama_ffn_hidden(int d_model, int multiple_of, double ffn_dim_multiplier) {
  XR_CHECK(d_model >= 1 && multiple_of >= 1, "llama_ffn_hidden: d_model ", d_model, ", multiple_of ", multiple_of);
  int64_t hidden = 2 * (4 * int64_t(d_model)) / 3;
  if (ffn_dim_multiplier > 0) hidden = int64_t(ffn_dim_multiplier * double(hidden));
  hidden = (hidden + multiple_of - 1) / multiple_of * multiple_of;
  return int(hidden);
}

int llama_ffn_hidden(const ModelDims& d) {
  return d.ffn_hidden > 0 ? d.ffn_hidden : llama_ffn_hidden(d.d_model, d.ffn_multiple_of, d.ffn_dim_multiplier);
}

std::string llama_layout_problem(const ModelDims& d, const ParallelLayout& l) {
  if ((d.d_model / d.n_head) % 2 != 0)
    return str_cat("model.d_model=", d.d_model, " / model.n_head=", d.n_head, " = ", d.d_model / d.n_head,
                   " is odd: rotary embeddings rotate pairs of a head's elements");
  if (d.n_head % l.tp != 0)
    return str_cat("model.n_head=", d.n_head, " is not divisible by parallel.tp=", l.tp,
                   " (tensor parallelism splits the heads)");
  if (d.kv_heads() % l.tp != 0)
    return str_cat("model.n_kv_head=", d.kv_heads(), " is not divisible by parallel.tp=", l.tp,
                   " (tensor parallelism splits the key/value heads)");
  if (llama_ffn_hidden(d) % l.tp != 0)
    return str_cat("the MLP width ", llama_ffn_hidden(d), " (model.ffn_hidden, or model.ffn_multiple_of and ",
                   "ffn_dim_multiplier) is not divisible by parallel.tp=", l.tp);
  if (d.padded_vocab() % l.tp != 0)
    return str_cat("padded vocabulary ", d.padded_vocab(), " (model.vocab_size=", d.vocab_size,
                   " rounded up to model.vocab_multiple=", d.vocab_multiple, ") is not divisible by parallel.tp=", l.tp,
                   "; make model.vocab_multiple a multiple of tp");
  return "";
}

// ---- the layers and their parameters

LlamaLayers::LlamaLayers(const ModelDims& d, const ChunkPlacement& at, int tp)
    : dims(d), placement(at), ffn_hidden(llama_ffn_hidden(d)) {
  if (at.has_embedding || (at.has_head && tied())) embed.emplace(d.vocab_size, d.padded_vocab());
  const int head_dim = d.d_model / d.n_head;
  for (int l = at.first_layer; l < at.end_layer; ++l)
    blocks.push_back({Norm(NormKind::RMSNorm, d.norm_eps), CausalSelfAttention(d.n_head, d.kv_heads(), head_dim, tp),
                      Norm(NormKind::RMSNorm, d.norm_eps), GatedMlp()});
  if (at.has_head) {
    norm.emplace(NormKind::RMSNorm, d.norm_eps);
    if (!tied()) lm_head.emplace(d.vocab_size, d.padded_vocab());
    head.emplace(d.vocab_size, d.padded_vocab());
  }
}

void LlamaLayers::declare(ParamList& list) {
  const int64_t C = dims.d_model;
  if (embed) {
    embed->declare(list, "embed_tokens.weight", C);
    // Tied: the first chunk holds the table for the input, the last a copy for the head.
    list.last().tied = tied() && !(placement.has_embedding && placement.has_head);
    list.last().tied_copy = !placement.has_embedding;
  }
  const InitRule w = InitRule::normal(0.02);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int l = placement.first_layer + int(i);
    const std::string p = "layers." + std::to_string(l) + ".";
    Block& b = blocks[i];
    b.input_norm.declare(list, p + "input_layernorm", C, l);
    b.attn.declare(list, p + "self_attn.qkv_proj", p + "self_attn.o_proj", C, l, w, w, /*bias=*/false);
    b.post_norm.declare(list, p + "post_attention_layernorm", C, l);
    b.mlp.declare(list, p + "mlp.gate_up_proj", p + "mlp.down_proj", C, ffn_hidden, l, w, w);
  }
  if (norm) norm->declare(list, "norm", C, dims.n_layer);
  // Final with the last norm: both complete when the head's backward has run.
  if (lm_head) lm_head->declare(list, "lm_head.weight", C, dims.n_layer);
}

void LlamaLayers::bind(std::vector<Parameter>& params) {
  if (embed) embed->bind(params);
  for (Block& b : blocks) {
    b.input_norm.bind(params);
    b.attn.bind(params);
    b.post_norm.bind(params);
    b.mlp.bind(params);
  }
  if (norm) norm->bind(params);
  if (lm_head) lm_head->bind(params);
}

std::vector<Parameter> llama_parameters(const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank, DType dtype,
                                        DType grad_dtype) {
  LlamaLayers layers(d, at, tp);
  ParamList list(tp, tp_rank, dtype, grad_dtype);
  layers.declare(list);
  return list.take();
}

ModelArch llama_arch() {
  ModelArch a;
  a.name = "llama";
  a.layout_problem = llama_layout_problem;
  a.make_chunk = [](const ModelDims& d, const ChunkPlacement& at, DType dt, const ChunkBatch& b,
                    const TensorParallel& tp) -> std::unique_ptr<ModelChunk> {
    return std::make_unique<Llama>(d, at, dt, b, tp);
  };
  a.parameters = [](const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank) {
    return llama_parameters(d, at, tp, tp_rank);
  };
  a.files = &llama_file_adapter();
  return a;
}

// ---- the chunk

Llama::Llama(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch,
             const TensorParallel& parallel)
    : ModelChunk(dims, placement, dtype, batch),
      tp_(parallel, int64_t(batch.micro_batch) * batch.seq_len),
      layers_(dims, placement, tp_.size()) {
  XR_CHECK(dims.n_head >= 1 && dims.d_model % dims.n_head == 0, "Llama: d_model ", dims.d_model, " % n_head ",
           dims.n_head);
  const std::string problem = llama_layout_problem(dims, ParallelLayout{1, tp_.size(), 1, 1});
  XR_CHECK(problem.empty(), "Llama: ", problem);
  XR_CHECK(batch.seq_len <= dims.max_seq_len, "seq_len ", batch.seq_len, " > max_seq_len ", dims.max_seq_len);
  ParamList list(tp_.size(), tp_.rank(), dtype_, wide_dtype_);
  layers_.declare(list);
  params_ = list.take();
  layers_.bind(params_);  // params_ does not grow again: the layers keep pointers into it
}

void Llama::layout_slot(Arena& acts, SlotActs& s) {
  const int64_t B = batch_.micro_batch, T = batch_.seq_len, C = dims_.d_model, P = tp_.size();
  const int64_t N = tp_.rows(), R = tp_.local_rows(), Hp = dims_.n_head / P, Fp = layers_.ffn_hidden / P;
  auto A = [&](Shape sh, const char* what) { return acts.alloc(sh, dtype_, what); };
  auto W = [&](Shape sh, const char* what) { return acts.alloc(sh, wide_dtype_, what); };
  const Recompute mode = batch_.recompute;
  s.input = A({R, C}, "stage input");
  s.blocks.resize(layers_.blocks.size());
  for (size_t l = 0; l < s.blocks.size(); ++l) {
    BlockActs& a = s.blocks[l];
    // Full recomputation keeps the block output only; selective drops the
    // attention core's outputs and the SwiGLU output.
    if (mode != Recompute::Full) {
      a.ln1 = A({R, C}, "input_layernorm output");
      a.ln1_rstd = W({R}, "input_layernorm rstd");
      a.qkv = A({B, T, layers_.blocks[l].attn.local_qkv_width()}, "qkv");
      if (mode == Recompute::None) {
        a.lse = W({B, Hp, T}, "attention log-sum-exp");
        a.atty = A({B, T, C / P}, "attention output");
      }
      a.res2 = A({R, C}, "residual 2");
      a.ln2 = A({R, C}, "post_attention_layernorm output");
      a.ln2_rstd = W({R}, "post_attention_layernorm rstd");
      a.gu = A({N, 2 * Fp}, "mlp gate and up");
      if (mode == Recompute::None) a.h = A({N, Fp}, "mlp swiglu");
    }
    a.res3 = A({R, C}, "block output");
  }
  if (placement_.has_head) {
    s.lnf = A({R, C}, "norm output");
    s.lnf_rstd = W({R}, "norm rstd");
    s.logits = A({N, dims_.padded_vocab() / P}, "logits");
    s.losses = W({N}, "losses");
  }
}

void Llama::layout_activations(Arena& acts) {
  const int64_t B = batch_.micro_batch, T = batch_.seq_len, C = dims_.d_model, N = tp_.rows(), R = tp_.local_rows();
  const int64_t P = tp_.size(), Hp = dims_.n_head / P, Fp = layers_.ffn_hidden / P;
  const Recompute mode = batch_.recompute;
  slots_.assign(size_t(batch_.activation_slots), {});
  for (auto& s : slots_) layout_slot(acts, s);
  work_ = {};
  if (mode != Recompute::None && !layers_.blocks.empty()) {
    auto A = [&](Shape sh, const char* what) { return acts.alloc(sh, dtype_, what); };
    auto W = [&](Shape sh, const char* what) { return acts.alloc(sh, wide_dtype_, what); };
    if (mode == Recompute::Full) {
      work_.ln1 = A({R, C}, "recomputed input_layernorm output");
      work_.ln1_rstd = W({R}, "recomputed input_layernorm rstd");
      work_.qkv = A({B, T, layers_.blocks[0].attn.local_qkv_width()}, "recomputed qkv");
    }
    work_.lse = W({B, Hp, T}, "recomputed attention log-sum-exp");
    work_.atty = A({B, T, C / P}, "recomputed attention output");
    if (mode == Recompute::Full) {
      work_.res2 = A({R, C}, "recomputed residual 2");
      work_.ln2 = A({R, C}, "recomputed post_attention_layernorm output");
      work_.ln2_rstd = W({R}, "recomputed post_attention_layernorm rstd");
      work_.gu = A({N, 2 * Fp}, "recomputed mlp gate and up");
    }
    work_.h = A({N, Fp}, "recomputed mlp swiglu");
  }
  tp_.layout(acts, C, dtype_);
  d_res_ = acts.alloc({R, C}, dtype_, "residual gradient");
  d_c_ = acts.alloc({R, C}, dtype_, "norm output gradient");
  int64_t width = 0;
  if (!layers_.blocks.empty())
    width = std::max<int64_t>(3 * layers_.ffn_hidden / P, C / P + layers_.blocks[0].attn.local_qkv_width());
  d_big_ = acts.alloc({N, std::max<int64_t>(width, 1)}, dtype_, "backward scratch");
  rope_ = RotaryTables{};
  rope_ready_ = false;
  if (!layers_.blocks.empty()) {
    const int64_t half = C / dims_.n_head / 2;
    rope_.cos = acts.alloc({batch_.seq_len, half}, wide_dtype_, "rotary cos");
    rope_.sin = acts.alloc({batch_.seq_len, half}, wide_dtype_, "rotary sin");
    rope_.seq_len = batch_.seq_len;
  }
  if (layers_.head) layers_.head->layout(acts, tp_, wide_dtype_);
  if (placement_.has_head) loss_sum_ = acts.alloc({1}, DType::F64, "loss sum");
  loss_pending_ = false;
}

Llama::BlockActs Llama::block_acts(SlotActs& s, size_t l) const {
  const BlockActs& kept = s.blocks[l];
  switch (batch_.recompute) {
    case Recompute::None: return kept;
    case Recompute::Selective: {
      BlockActs a = kept;
      a.lse = work_.lse;
      a.atty = work_.atty;
      a.h = work_.h;
      return a;
    }
    case Recompute::Full: break;
  }
  BlockActs a = work_;
  a.res3 = kept.res3;
  return a;
}

void Llama::recompute(const KernelContext& ctx, const LlamaLayers::Block& b, const Tensor& x, BlockActs& a) {
  if (batch_.recompute == Recompute::None) return;
  const double t0 = now_seconds();
  if (batch_.recompute == Recompute::Full) {
    block_forward(ctx, b, x, a, /*whole=*/false);
  } else {
    b.attn.attend(ctx, a.qkv, a.lse, a.atty);  // qkv holds q and k rotated
    swiglu_packed_forward(ctx, a.h, a.gu);
  }
  add_span(ctx.timeline, "recompute", Track::Main, t0, now_seconds());
}

void Llama::ensure_rope(const KernelContext& ctx) {
  if (rope_ready_ || layers_.blocks.empty()) return;
  rope_table(ctx, rope_.cos, rope_.sin, dims_.rope);
  rope_ready_ = true;
}

// ---- forward

void Llama::block_forward(const KernelContext& ctx, const LlamaLayers::Block& b, const Tensor& x, BlockActs& a,
                          bool whole) {
  b.input_norm.forward(ctx, a.ln1, Tensor(), a.ln1_rstd, x);
  b.attn.forward(ctx, a.qkv, a.lse, a.atty, tp_.gathered(a.ln1), &rope_);
  Tensor ln2 = a.ln2;
  if (tp_.split()) {
    b.attn.proj().forward(ctx, tp_, a.res2, a.atty.flat2d(), x);
    b.post_norm.forward(ctx, a.ln2, Tensor(), a.ln2_rstd, a.res2);
    ln2 = tp_.gathered(a.ln2);
  } else {
    // One rank: the residual add rides on the RMSNorm.
    b.attn.proj().forward_unsplit(ctx, a.res2, a.atty.flat2d());
    b.post_norm.residual_forward(ctx, a.res2, a.ln2, Tensor(), a.ln2_rstd, a.res2, x);
  }
  if (whole) b.mlp.forward(ctx, tp_, a.res3, a.gu, a.h, ln2, a.res2);
  else b.mlp.forward_hidden(ctx, a.gu, a.h, ln2);
}

void Llama::head_forward(const KernelContext& ctx, SlotActs& s, const Tensor& x, const Tensor& targets, double dloss) {
  check_shape("Llama::forward", "targets", targets, {batch_.micro_batch, batch_.seq_len});
  layers_.norm->forward(ctx, s.lnf, Tensor(), s.lnf_rstd, x);
  layers_.head->forward(ctx, tp_, layers_.head_table(), s.logits, s.losses, tp_.gathered(s.lnf), targets, dloss);
  if (!loss_pending_) zero(ctx, loss_sum_);
  mean_accumulate(ctx, loss_sum_, s.losses);
  loss_pending_ = true;
}

double Llama::take_loss(const KernelContext& ctx) {
  if (!placement_.has_head || !loss_pending_) return 0.0;
  double sum = 0;
  copy_bytes(&sum, Device::CPU, loss_sum_.raw(), loss_sum_.device(), sizeof(double), ctx.cuda_stream, true);
  loss_pending_ = false;
  return sum;
}

void Llama::forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets, double dloss) {
  XR_CHECK(tp_.can_run(), "Llama: a chunk laid out without its tensor-parallel group cannot run");
  tp_.begin_pass(ctx);
  ensure_rope(ctx);
  SlotActs& s = slots_.at(size_t(slot));
  if (placement_.has_embedding) {
    check_shape("Llama::forward", "tokens", tokens, {batch_.micro_batch, batch_.seq_len});
    layers_.embed->forward(ctx, tp_, s.input, tokens);
  }
  const Tensor* x = &s.input;
  for (size_t l = 0; l < layers_.blocks.size(); ++l) {
    BlockActs a = block_acts(s, l);
    block_forward(ctx, layers_.blocks[l], *x, a);
    x = &s.blocks[l].res3;
  }
  if (placement_.has_head) head_forward(ctx, s, *x, targets, dloss);
}

// ---- backward: the mirror of forward

void Llama::block_backward(const KernelContext& ctx, const LlamaLayers::Block& b, const Tensor& x, BlockActs& a,
                           GradPhase phase) {
  const int64_t N = tp_.rows(), Cp = dims_.d_model / tp_.size(), Fp = layers_.ffn_hidden / tp_.size();
  const int64_t Q = b.attn.local_qkv_width();
  Tensor flat = d_big_.flat();
  Tensor dgu = flat.flat_range(0, N * 2 * Fp).view({N, 2 * Fp});
  Tensor dh = flat.flat_range(N * 2 * Fp, N * 3 * Fp).view({N, Fp});
  Tensor datty = flat.flat_range(0, N * Cp).view({N, Cp});
  Tensor dqkv = flat.flat_range(N * Cp, N * (Cp + Q)).view(a.qkv.shape());

  Tensor dy = tp_.full_rows(d_res_);
  b.mlp.backward(ctx, tp_, dgu, dh, dy, a.gu, a.h, tp_.gathered(a.ln2));
  b.post_norm.backward(ctx, d_res_, ColumnParallelLinear::input_grad(tp_, d_c_), a.res2, Tensor(), a.ln2_rstd);

  dy = tp_.full_rows(d_res_);
  b.attn.proj().backward(ctx, datty, dy, a.atty.flat2d());
  b.attn.backward(ctx, tp_, dqkv, datty.view(a.atty.shape()), a.qkv, a.atty, a.lse, tp_.gathered(a.ln1), &rope_);
  b.input_norm.backward(ctx, d_res_, ColumnParallelLinear::input_grad(tp_, d_c_), x, Tensor(), a.ln1_rstd);
  if (phase == GradPhase::Final) {
    b.input_norm.reduce_grads(tp_);
    b.post_norm.reduce_grads(tp_);
  }
}

void Llama::head_backward(const KernelContext& ctx, SlotActs& s, GradPhase phase) {
  const Tensor& last = layers_.blocks.empty() ? s.input : s.blocks.back().res3;
  layers_.head->backward(ctx, tp_, layers_.head_table(), s.logits, tp_.gathered(s.lnf));
  Tensor dlnf = tp_.partial();
  if (tp_.split()) {
    tp_.reduce_rows(tp_.partial(), tp_.sequence_parallel() ? d_c_ : tp_.partial());
    if (tp_.sequence_parallel()) dlnf = d_c_;
  }
  zero(ctx, d_res_);
  layers_.norm->backward(ctx, d_res_, dlnf, last, Tensor(), s.lnf_rstd);
  if (phase == GradPhase::Final) layers_.norm->reduce_grads(tp_);
}

Tensor Llama::stage_output(int slot) {
  SlotActs& s = slots_.at(size_t(slot));
  return layers_.blocks.empty() ? s.input : s.blocks.back().res3;
}

void Llama::backward(const KernelContext& ctx, int slot, const Tensor& tokens, GradPhase phase,
                     const Tensor& output_grad, BackwardPart part) {
  XR_CHECK(part == BackwardPart::Full, "Llama runs the whole backward pass in one part (splits_backward() is false)");
  XR_CHECK(tp_.can_run(), "Llama: a chunk laid out without its tensor-parallel group cannot run");
  tp_.begin_pass(ctx);
  SlotActs& s = slots_.at(size_t(slot));
  const bool final_pass = phase == GradPhase::Final;
  if (placement_.has_head) {
    head_backward(ctx, s, phase);
    if (final_pass) grad_ready(dims_.n_layer);
  } else {
    check_shape("Llama::backward", "output_grad", output_grad, d_res_.shape());
    copy_tensor(d_res_, output_grad, ctx.cuda_stream, false);
  }
  for (int l = int(layers_.blocks.size()) - 1; l >= 0; --l) {
    const Tensor& x = l == 0 ? s.input : s.blocks[size_t(l - 1)].res3;
    BlockActs a = block_acts(s, size_t(l));
    recompute(ctx, layers_.blocks[size_t(l)], x, a);
    block_backward(ctx, layers_.blocks[size_t(l)], x, a, phase);
    if (final_pass) grad_ready(placement_.first_layer + l);
  }
  if (placement_.has_embedding) {
    const Tensor dy = tp_.full_rows(d_res_);
    layers_.embed->backward(ctx, tp_, dy, tokens);
    if (final_pass) grad_ready(-1);
  }
}

double Llama::flops_per_token() const {
  const double L = dims_.n_layer, C = dims_.d_model, T = batch_.seq_len;
  const double D = C / dims_.n_head, KV = dims_.kv_heads(), F = layers_.ffn_hidden;
  // q and o: C x C each; k and v: C x KV D each; gate, up, down: C x F each.
  const double per_layer = 2.0 * C * C + 2.0 * C * KV * D + 3.0 * C * F;
  const double matrix_params = L * per_layer + double(dims_.padded_vocab()) * C;
  // Attention scores and values: 4 T C per layer forward over the query heads, whatever KV.
  return 6.0 * matrix_params + 12.0 * L * C * T;
}

}  // namespace xirang
