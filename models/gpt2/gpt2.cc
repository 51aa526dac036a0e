#include "models/gpt2/gpt2.h"

#include <string>

#include "core/clock.h"
#include "core/device_memory.h"
#include "core/timeline.h"
#include "kernels/elementwise.h"
#include "models/gpt2/gpt2_files.h"

namespace xirang {

namespace {

std::string gpt2_layout_problem(const ModelDims& d, const ParallelLayout& l) {
  if (d.n_head % l.tp != 0)
    return str_cat("model.n_head=", d.n_head, " is not divisible by parallel.tp=", l.tp,
                   " (tensor parallelism splits the heads)");
  if (d.padded_vocab() % l.tp != 0)
    return str_cat("padded vocabulary ", d.padded_vocab(), " (model.vocab_size=", d.vocab_size,
                   " rounded up to model.vocab_multiple=", d.vocab_multiple, ") is not divisible by parallel.tp=", l.tp,
                   "; make model.vocab_multiple a multiple of tp");
  return "";
}

}  // namespace

// ---- the layers and their parameters

GPT2Layers::GPT2Layers(const ModelDims& d, const ChunkPlacement& at, int tp) : dims(d), placement(at) {
  // The activation and gradient buffers are laid out for a 3C-wide qkv.
  XR_CHECK(d.kv_heads() == d.n_head, "GPT-2 has no grouped-query attention: model.n_kv_head ", d.n_kv_head,
           " must be 0 or n_head ", d.n_head);
  if (at.has_embedding || at.has_head) wte.emplace(d.vocab_size, d.padded_vocab());
  if (at.has_embedding) wpe.emplace();
  const int head_dim = d.d_model / d.n_head;
  for (int l = at.first_layer; l < at.end_layer; ++l)
    blocks.push_back({Norm(), CausalSelfAttention(d.n_head, d.kv_heads(), head_dim, tp), Norm(), Mlp()});
  if (at.has_head) {
    ln_f.emplace();
    head.emplace(d.vocab_size, d.padded_vocab());
  }
}

void GPT2Layers::declare(ParamList& list) {
  const int64_t C = dims.d_model;
  if (wte) {
    // The token table is tied to the head: the first chunk holds it for the
    // input, the last chunk a copy for the head.
    wte->declare(list, "wte.weight", C);
    list.last().tied = !(placement.has_embedding && placement.has_head);
    list.last().tied_copy = !placement.has_embedding;
  }
  if (wpe) wpe->declare(list, "wpe.weight", dims.max_seq_len, C);
  const InitRule w = InitRule::normal(0.02), proj = InitRule::scaled_residual(0.02, dims.n_layer);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int l = placement.first_layer + int(i);
    const std::string p = "h." + std::to_string(l) + ".";
    Block& b = blocks[i];
    b.ln1.declare(list, p + "ln_1", C, l);
    b.attn.declare(list, p + "attn.c_attn", p + "attn.c_proj", C, l, w, proj);
    b.ln2.declare(list, p + "ln_2", C, l);
    b.mlp.declare(list, p + "mlp.c_fc", p + "mlp.c_proj", C, 4 * C, l, w, proj);
  }
  if (ln_f) ln_f->declare(list, "ln_f", C, dims.n_layer);
}

void GPT2Layers::bind(std::vector<Parameter>& params) {
  if (wte) wte->bind(params);
  if (wpe) wpe->bind(params);
  for (Block& b : blocks) {
    b.ln1.bind(params);
    b.attn.bind(params);
    b.ln2.bind(params);
    b.mlp.bind(params);
  }
  if (ln_f) ln_f->bind(params);
}

std::vector<Parameter> gpt2_parameters(const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank, DType dtype,
                                       DType grad_dtype) {
  GPT2Layers layers(d, at, tp);
  ParamList list(tp, tp_rank, dtype, grad_dtype);
  layers.declare(list);
  return list.take();
}

ModelArch gpt2_arch() {
  ModelArch a;
  a.name = "gpt2";
  a.layout_problem = gpt2_layout_problem;
  a.make_chunk = [](const ModelDims& d, const ChunkPlacement& at, DType dt, const ChunkBatch& b,
                    const TensorParallel& tp) -> std::unique_ptr<ModelChunk> {
    return std::make_unique<GPT2>(d, at, dt, b, tp);
  };
  a.parameters = [](const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank) {
    return gpt2_parameters(d, at, tp, tp_rank);
  };
  a.files = &gpt2_file_adapter();
  return a;
}

// ---- the chunk

GPT2::GPT2(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch,
           const TensorParallel& parallel)
    : ModelChunk(dims, placement, dtype, batch),
      tp_(parallel, int64_t(batch.micro_batch) * batch.seq_len),
      layers_(dims, placement, tp_.size()) {
  // The architecture's own rules (a chunk may hold no blocks: tests build such).
  XR_CHECK(dims.n_head >= 1 && dims.d_model % dims.n_head == 0, "GPT2: d_model ", dims.d_model, " % n_head ",
           dims.n_head);
  const std::string problem = gpt2_layout_problem(dims, ParallelLayout{1, tp_.size(), 1, 1});
  XR_CHECK(problem.empty(), "GPT2: ", problem);
  XR_CHECK(batch.seq_len <= dims.max_seq_len, "seq_len ", batch.seq_len, " > max_seq_len ", dims.max_seq_len);
  ParamList list(tp_.size(), tp_.rank(), dtype_, wide_dtype_);
  layers_.declare(list);
  params_ = list.take();
  layers_.bind(params_);  // params_ does not grow again: the layers keep pointers into it
}

void GPT2::layout_slot(Arena& acts, SlotActs& s) {
  const int64_t B = batch_.micro_batch, T = batch_.seq_len, C = dims_.d_model, P = tp_.size();
  const int64_t N = tp_.rows(), R = tp_.local_rows(), Hp = dims_.n_head / P;
  auto A = [&](Shape sh, const char* what) { return acts.alloc(sh, dtype_, what); };
  auto W = [&](Shape sh, const char* what) { return acts.alloc(sh, wide_dtype_, what); };  // statistics, losses
  const Recompute mode = batch_.recompute;
  s.input = A({R, C}, "stage input");
  s.blocks.resize(layers_.blocks.size());
  for (size_t l = 0; l < s.blocks.size(); ++l) {
    BlockActs& a = s.blocks[l];
    // Full recomputation keeps the block output only; selective drops the attention core's outputs and,
    // with drop_gelu_, the GELU output.
    if (mode != Recompute::Full) {
      a.ln1 = A({R, C}, "ln_1 output");
      a.ln1_mean = W({R}, "ln_1 mean");
      a.ln1_rstd = W({R}, "ln_1 rstd");
      a.qkv = A({B, T, layers_.blocks[l].attn.local_qkv_width()}, "qkv");
      if (mode == Recompute::None) {
        a.lse = W({B, Hp, T}, "attention log-sum-exp");
        a.atty = A({B, T, C / P}, "attention output");
      }
      a.res2 = A({R, C}, "residual 2");
      a.ln2 = A({R, C}, "ln_2 output");
      a.ln2_mean = W({R}, "ln_2 mean");
      a.ln2_rstd = W({R}, "ln_2 rstd");
      a.fch = A({N, 4 * C / P}, "mlp hidden");
      if (mode == Recompute::None || !drop_gelu_) a.fch_gelu = A({N, 4 * C / P}, "mlp gelu");
    }
    a.res3 = A({R, C}, "block output");
  }
  if (placement_.has_head) {
    s.lnf = A({R, C}, "ln_f output");
    s.lnf_mean = W({R}, "ln_f mean");
    s.lnf_rstd = W({R}, "ln_f rstd");
    s.logits = A({N, dims_.padded_vocab() / P}, "logits");
    s.losses = W({N}, "losses");
  }
}

void GPT2::layout_activations(Arena& acts) {
  const int64_t B = batch_.micro_batch, T = batch_.seq_len, C = dims_.d_model, P = tp_.size();
  const int64_t N = tp_.rows(), R = tp_.local_rows(), Hp = dims_.n_head / P;
  const Recompute mode = batch_.recompute;
  // With 16-bit storage a device's fused GELU epilogue rounds differently from GELU of the stored fc output.
  drop_gelu_ = mode == Recompute::Selective && (dtype_ == DType::F32 || dtype_ == DType::F64);
  slots_.assign(size_t(batch_.activation_slots), {});
  for (auto& s : slots_) layout_slot(acts, s);
  work_ = {};
  if (mode != Recompute::None && !layers_.blocks.empty()) {
    auto A = [&](Shape sh, const char* what) { return acts.alloc(sh, dtype_, what); };
    auto W = [&](Shape sh, const char* what) { return acts.alloc(sh, wide_dtype_, what); };
    if (mode == Recompute::Full) {
      work_.ln1 = A({R, C}, "recomputed ln_1 output");
      work_.ln1_mean = W({R}, "recomputed ln_1 mean");
      work_.ln1_rstd = W({R}, "recomputed ln_1 rstd");
      work_.qkv = A({B, T, layers_.blocks[0].attn.local_qkv_width()}, "recomputed qkv");
    }
    work_.lse = W({B, Hp, T}, "recomputed attention log-sum-exp");
    work_.atty = A({B, T, C / P}, "recomputed attention output");
    if (mode == Recompute::Full) {
      work_.res2 = A({R, C}, "recomputed residual 2");
      work_.ln2 = A({R, C}, "recomputed ln_2 output");
      work_.ln2_mean = W({R}, "recomputed ln_2 mean");
      work_.ln2_rstd = W({R}, "recomputed ln_2 rstd");
      work_.fch = A({N, 4 * C / P}, "recomputed mlp hidden");
    }
    if (mode == Recompute::Full || drop_gelu_) work_.fch_gelu = A({N, 4 * C / P}, "recomputed mlp gelu");
  }
  tp_.layout(acts, C, dtype_);
  d_res_ = acts.alloc({R, C}, dtype_, "residual gradient");
  d_c_ = acts.alloc({R, C}, dtype_, "LayerNorm output gradient");
  d_big_ = acts.alloc({N, 4 * C / tp_.size()}, dtype_, "backward scratch (4C/P)");
  if (layers_.head) layers_.head->layout(acts, tp_, wide_dtype_);
  if (placement_.has_head) loss_sum_ = acts.alloc({1}, DType::F64, "loss sum");
  loss_pending_ = false;
}

GPT2::BlockActs GPT2::block_acts(SlotActs& s, size_t l) const {
  const BlockActs& kept = s.blocks[l];
  switch (batch_.recompute) {
    case Recompute::None: return kept;
    case Recompute::Selective: {
      BlockActs a = kept;
      a.lse = work_.lse;
      a.atty = work_.atty;
      if (drop_gelu_) a.fch_gelu = work_.fch_gelu;
      return a;
    }
    case Recompute::Full: break;
  }
  BlockActs a = work_;
  a.res3 = kept.res3;
  return a;
}

void GPT2::recompute(const KernelContext& ctx, const GPT2Layers::Block& b, const Tensor& x, BlockActs& a) {
  if (batch_.recompute == Recompute::None) return;
  const double t0 = now_seconds();
  if (batch_.recompute == Recompute::Full) {
    block_forward(ctx, b, x, a, /*whole=*/false);
  } else {
    b.attn.attend(ctx, a.qkv, a.lse, a.atty);
    if (drop_gelu_) gelu_forward(ctx, a.fch_gelu, a.fch);
  }
  add_span(ctx.timeline, "recompute", Track::Main, t0, now_seconds());
}

// ---- forward

void GPT2::block_forward(const KernelContext& ctx, const GPT2Layers::Block& b, const Tensor& x, BlockActs& a,
                         bool whole) {
  b.ln1.forward(ctx, a.ln1, a.ln1_mean, a.ln1_rstd, x);
  b.attn.forward(ctx, a.qkv, a.lse, a.atty, tp_.gathered(a.ln1));
  Tensor ln2 = a.ln2;
  if (tp_.split()) {
    b.attn.proj().forward(ctx, tp_, a.res2, a.atty.flat2d(), x);
    b.ln2.forward(ctx, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2);
    ln2 = tp_.gathered(a.ln2);
  } else {
    // One rank: the bias rides on the product, the residual add on the LayerNorm.
    b.attn.proj().forward_unsplit(ctx, a.res2, a.atty.flat2d());
    b.ln2.residual_forward(ctx, a.res2, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, x);
  }
  if (whole) b.mlp.forward(ctx, tp_, a.res3, a.fch, a.fch_gelu, ln2, a.res2);
  else b.mlp.forward_hidden(ctx, a.fch, a.fch_gelu, ln2);
}

void GPT2::head_forward(const KernelContext& ctx, SlotActs& s, const Tensor& x, const Tensor& targets, double dloss) {
  check_shape("GPT2::forward", "targets", targets, {batch_.micro_batch, batch_.seq_len});
  layers_.ln_f->forward(ctx, s.lnf, s.lnf_mean, s.lnf_rstd, x);
  layers_.head->forward(ctx, tp_, layers_.wte->table(), s.logits, s.losses, tp_.gathered(s.lnf), targets, dloss);
  // The microbatch's mean loss joins the step's sum on the device: the host
  // reads it once, in take_loss().
  if (!loss_pending_) zero(ctx, loss_sum_);
  mean_accumulate(ctx, loss_sum_, s.losses);
  loss_pending_ = true;
}

double GPT2::take_loss(const KernelContext& ctx) {
  if (!placement_.has_head || !loss_pending_) return 0.0;
  double sum = 0;
  copy_bytes(&sum, Device::CPU, loss_sum_.raw(), loss_sum_.device(), sizeof(double), ctx.cuda_stream, true);
  loss_pending_ = false;
  return sum;
}

void GPT2::forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets, double dloss) {
  XR_CHECK(tp_.can_run(), "GPT2: a chunk laid out without its tensor-parallel group cannot run");
  tp_.begin_pass(ctx);
  SlotActs& s = slots_.at(size_t(slot));
  if (placement_.has_embedding) {
    check_shape("GPT2::forward", "tokens", tokens, {batch_.micro_batch, batch_.seq_len});
    layers_.wte->forward(ctx, tp_, s.input, tokens);
    layers_.wpe->forward(ctx, s.input, batch_.seq_len, tp_.sequence_parallel() ? tp_.rank() * tp_.local_rows() : 0);
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

// On entry d_res_ holds d(block output) for the local rows; on exit d(block
// input). Residual adds need no op: the gradient passes through d_res_ and
// the LayerNorm backward passes accumulate into it.
void GPT2::block_backward(const KernelContext& ctx, const GPT2Layers::Block& b, const Tensor& x, BlockActs& a,
                          GradPhase phase) {
  const int64_t N = tp_.rows(), Cp = dims_.d_model / tp_.size();
  Tensor d4 = d_big_;                                                                // (N, 4C/P)
  Tensor datty = d_big_.flat().flat_range(0, N * Cp).view({N, Cp});                  // (N, C/P)
  Tensor dqkv = d_big_.flat().flat_range(N * Cp, N * 4 * Cp).view(a.qkv.shape());   // (B, T, 3C/P)

  Tensor dy = tp_.full_rows(d_res_);
  b.mlp.backward(ctx, tp_, d4, dy, a.fch, a.fch_gelu, tp_.gathered(a.ln2));
  b.ln2.backward(ctx, d_res_, ColumnParallelLinear::input_grad(tp_, d_c_), a.res2, a.ln2_mean, a.ln2_rstd);

  dy = tp_.full_rows(d_res_);
  b.attn.proj().backward(ctx, datty, dy, a.atty.flat2d());
  b.attn.backward(ctx, tp_, dqkv, datty.view(a.atty.shape()), a.qkv, a.atty, a.lse, tp_.gathered(a.ln1));
  b.ln1.backward(ctx, d_res_, ColumnParallelLinear::input_grad(tp_, d_c_), x, a.ln1_mean, a.ln1_rstd);
  if (phase == GradPhase::Final) {
    b.ln1.reduce_grads(tp_);
    b.ln2.reduce_grads(tp_);
  }
}

void GPT2::head_backward(const KernelContext& ctx, SlotActs& s, GradPhase phase) {
  // The training forward left dlogits in s.logits.
  const Tensor& last = layers_.blocks.empty() ? s.input : s.blocks.back().res3;
  layers_.head->backward(ctx, tp_, layers_.wte->table(), s.logits, tp_.gathered(s.lnf));
  Tensor dlnf = tp_.partial();
  if (tp_.split()) {
    tp_.reduce_rows(tp_.partial(), tp_.sequence_parallel() ? d_c_ : tp_.partial());
    if (tp_.sequence_parallel()) dlnf = d_c_;
  }
  zero(ctx, d_res_);
  layers_.ln_f->backward(ctx, d_res_, dlnf, last, s.lnf_mean, s.lnf_rstd);
  if (phase == GradPhase::Final) layers_.ln_f->reduce_grads(tp_);
}

Tensor GPT2::stage_output(int slot) {
  SlotActs& s = slots_.at(size_t(slot));
  return layers_.blocks.empty() ? s.input : s.blocks.back().res3;
}

void GPT2::backward(const KernelContext& ctx, int slot, const Tensor& tokens, GradPhase phase,
                    const Tensor& output_grad, BackwardPart part) {
  XR_CHECK(part == BackwardPart::Full, "GPT2 runs the whole backward pass in one part (splits_backward() is false)");
  XR_CHECK(tp_.can_run(), "GPT2: a chunk laid out without its tensor-parallel group cannot run");
  tp_.begin_pass(ctx);
  SlotActs& s = slots_.at(size_t(slot));
  const bool final_pass = phase == GradPhase::Final;
  if (placement_.has_head) {
    head_backward(ctx, s, phase);
    if (final_pass) grad_ready(dims_.n_layer);
  } else {
    check_shape("GPT2::backward", "output_grad", output_grad, d_res_.shape());
    copy_tensor(d_res_, output_grad, ctx.cuda_stream, false);  // in stream order on a device
  }
  for (int l = int(layers_.blocks.size()) - 1; l >= 0; --l) {
    const Tensor& x = l == 0 ? s.input : s.blocks[size_t(l - 1)].res3;
    BlockActs a = block_acts(s, size_t(l));
    recompute(ctx, layers_.blocks[size_t(l)], x, a);
    block_backward(ctx, layers_.blocks[size_t(l)], x, a, phase);
    if (final_pass) grad_ready(placement_.first_layer + l);
  }
  if (placement_.has_embedding) {
    // Every rank needs the gradient of all N rows: its table shard serves tokens from any row.
    const Tensor dy = tp_.full_rows(d_res_);
    layers_.wte->backward(ctx, tp_, dy, tokens);
    layers_.wpe->backward(ctx, dy, batch_.seq_len);
    if (final_pass) grad_ready(-1);
  }
}

double GPT2::flops_per_token() const {
  const double L = dims_.n_layer, C = dims_.d_model, T = batch_.seq_len;
  const double matrix_params = L * 12.0 * C * C + double(dims_.padded_vocab()) * C;
  return 6.0 * matrix_params + 12.0 * L * C * T;
}

}  // namespace xirang
