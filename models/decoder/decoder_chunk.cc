#include "models/decoder/decoder_chunk.h"

#include <algorithm>
#include <string>

#include "core/clock.h"
#include "core/device_memory.h"
#include "core/timeline.h"
#include "kernels/elementwise.h"
#include "kernels/rope.h"
#include "models/decode.h"
#include "models/layers/moe_ffn.h"

namespace xirang {

// ---- the layers and their parameters

DecoderLayers::DecoderLayers(const DecoderSpec& s, const ModelDims& d, const ChunkPlacement& at, int tp)
    : spec(s), dims(d), placement(at) {
  // Without grouped-query attention the activation and gradient buffers are laid out for a 3C-wide qkv.
  XR_CHECK(spec.grouped_query || d.kv_heads() == d.n_head, spec.name, " has no grouped-query attention: ",
           "model.n_kv_head ", d.n_kv_head, " must be 0 or n_head ", d.n_head);
  if (at.has_embedding || (at.has_head && spec.tied)) embed.emplace(d.vocab_size, d.padded_vocab());
  if (at.has_embedding && !spec.rotary) positions.emplace();
  for (int l = at.first_layer; l < at.end_layer; ++l)
    blocks.push_back({Norm(spec.norm, d.norm_eps),
                      CausalSelfAttention(d.n_head, d.kv_heads(), spec.resolved_head_dim(d), tp,
                                          {.bias = spec.bias, .qk_norm = spec.qk_norm, .qk_eps = d.norm_eps}),
                      Norm(spec.norm, d.norm_eps), make_feed_forward(spec.ffn, d.moe)});
  if (at.has_head) {
    final_norm.emplace(spec.norm, d.norm_eps);
    if (!spec.tied) lm_head.emplace(d.vocab_size, d.padded_vocab());
    head.emplace(d.vocab_size, d.padded_vocab());
  }
}

void DecoderLayers::declare(ParamList& list) {
  const int64_t C = dims.d_model;
  const DecoderSpec::Names& n = spec.names;
  if (embed) {
    // Tied: the first chunk holds the table for the input, the last a copy for the head.
    embed->declare(list, n.embed, C);
    list.last().tied = spec.tied && !(placement.has_embedding && placement.has_head);
    list.last().tied_copy = !placement.has_embedding;
  }
  if (positions) positions->declare(list, n.positions, dims.max_seq_len, C);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int l = placement.first_layer + int(i);
    const std::string p = n.block + std::to_string(l) + ".";
    Block& b = blocks[i];
    b.norm1.declare(list, p + n.norm1, C, l);
    b.attn.declare(list, {.qkv = p + n.qkv, .proj = p + n.proj, .q_norm = p + n.q_norm, .k_norm = p + n.k_norm}, C,
                   l, spec.weight, spec.residual);
    b.norm2.declare(list, p + n.norm2, C, l);
    b.ffn->declare(list, p + n.up, p + n.down, C, spec.ffn_hidden, l, spec.weight, spec.residual, spec.bias);
  }
  if (final_norm) final_norm->declare(list, n.final_norm, C, dims.n_layer);
  // Final with the last norm: both complete when the head's backward has run.
  if (lm_head) lm_head->declare(list, n.head, C, dims.n_layer);
}

void DecoderLayers::bind(std::vector<Parameter>& params) {
  if (embed) embed->bind(params);
  if (positions) positions->bind(params);
  for (Block& b : blocks) {
    b.norm1.bind(params);
    b.attn.bind(params);
    b.norm2.bind(params);
    b.ffn->bind(params);
  }
  if (final_norm) final_norm->bind(params);
  if (lm_head) lm_head->bind(params);
}

std::vector<Parameter> decoder_parameters(const DecoderSpec& spec, const ModelDims& d, const ChunkPlacement& at,
                                          int tp, int tp_rank, DType dtype, DType grad_dtype) {
  DecoderLayers layers(spec, d, at, tp);
  ParamList list(tp, tp_rank, dtype, grad_dtype);
  layers.declare(list);
  return list.take();
}

std::string decoder_layout_problem(const DecoderSpec& spec, const ModelDims& d, const ParallelLayout& l) {
  const int D = spec.resolved_head_dim(d);
  if (spec.rotary && D % 2 != 0)
    return d.head_dim > 0 ? str_cat("model.head_dim=", D, " is odd: rotary embeddings rotate pairs of a head's elements")
                          : str_cat("model.d_model=", d.d_model, " / model.n_head=", d.n_head, " = ", D,
                                    " is odd: rotary embeddings rotate pairs of a head's elements");
  if (d.n_head % l.tp != 0)
    return str_cat("model.n_head=", d.n_head, " is not divisible by parallel.tp=", l.tp,
                   " (tensor parallelism splits the heads)");
  if (d.kv_heads() % l.tp != 0)
    return str_cat("model.n_kv_head=", d.kv_heads(), " is not divisible by parallel.tp=", l.tp,
                   " (tensor parallelism splits the key/value heads)");
  if (spec.ffn == FfnKind::Moe && l.tp > 1)
    return str_cat("model.moe.num_experts=", d.moe.num_experts, " with parallel.tp=", l.tp,
                   ": the mixture-of-experts layer runs without tensor parallelism so far (tp=1)");
  if (spec.ffn_hidden % l.tp != 0)
    return str_cat("the MLP width ", spec.ffn_hidden, " (", spec.ffn_keys, ") is not divisible by parallel.tp=", l.tp);
  if (d.padded_vocab() % l.tp != 0)
    return str_cat("padded vocabulary ", d.padded_vocab(), " (model.vocab_size=", d.vocab_size,
                   " rounded up to model.vocab_multiple=", d.vocab_multiple, ") is not divisible by parallel.tp=", l.tp,
                   "; make model.vocab_multiple a multiple of tp");
  return spec.layout_problem ? spec.layout_problem(d, l) : "";
}

std::vector<KeyRule> moe_key_rules(const DecoderSpec& spec, const ModelDims& d) {
  const MoeDims& m = d.moe;
  if (m.num_experts == 0) return {};
  if (m.num_experts < 0) return {KeyRule::at_least("model.moe.num_experts", m.num_experts, 0, " (0: a dense feed-forward)")};
  if (spec.ffn != FfnKind::Moe)
    return {KeyRule::refused("model.moe.num_experts",
                             str_cat("model.moe.num_experts=", m.num_experts, ": model.arch=", d.arch,
                                     " has no mixture-of-experts feed-forward (use 0, or arch llama or qwen3)"))};
  std::vector<KeyRule> r = {KeyRule::at_least("model.moe.top_k", m.top_k, 1)};
  if (m.top_k > m.num_experts)
    r.push_back(KeyRule::refused("model.moe.top_k", str_cat("model.moe.top_k=", m.top_k, " exceeds model.moe.num_experts=",
                                                            m.num_experts, " (each token takes top_k distinct experts)")));
  r.push_back(KeyRule::at_least("model.moe.expert_hidden", m.expert_hidden, 0, " (0: the dense width, model.ffn_hidden)"));
  r.push_back(KeyRule::at_least("model.moe.shared_hidden", m.shared_hidden, 0, " (0: no shared experts)"));
  r.push_back(KeyRule::non_negative("model.moe.bias_update_rate", m.bias_update_rate, " (0 turns the selection bias off)"));
  r.push_back(KeyRule::non_negative("model.moe.aux_loss_coeff", m.aux_loss_coeff));
  return r;
}

ModelArch decoder_arch(std::string name, DecoderSpec (*spec)(const ModelDims&), const ModelFileAdapter* files) {
  ModelArch a;
  a.name = std::move(name);
  a.layout_problem = [spec](const ModelDims& d, const ParallelLayout& l) {
    return decoder_layout_problem(spec(d), d, l);
  };
  a.make_chunk = [spec](const ModelDims& d, const ChunkPlacement& at, DType dt, const ChunkBatch& b,
                        const TensorParallel& tp) -> std::unique_ptr<ModelChunk> {
    return std::make_unique<DecoderChunk>(spec(d), d, at, dt, b, tp);
  };
  a.parameters = [spec](const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank) {
    return decoder_parameters(spec(d), d, at, tp, tp_rank);
  };
  a.key_rules = [spec](const ModelDims& d) {
    const DecoderSpec s = spec(d);
    std::vector<KeyRule> rules = s.key_rules ? s.key_rules(d) : std::vector<KeyRule>{};
    for (KeyRule& r : moe_key_rules(s, d)) rules.push_back(std::move(r));
    return rules;
  };
  a.make_decoder = [spec](ModelChunk& c, Device device, int logits_rows) {
    return make_spec_decoder(spec(c.dims()), c, device, logits_rows);
  };
  a.files = files;
  return a;
}

// ---- the chunk and its activations

DecoderChunk::DecoderChunk(const DecoderSpec& spec, const ModelDims& dims, const ChunkPlacement& placement,
                           DType dtype, const ChunkBatch& batch, const TensorParallel& parallel)
    : ModelChunk(dims, placement, dtype, batch),
      cp_(batch.cp, batch.micro_batch, batch.seq_len),
      tp_(parallel, int64_t(batch.micro_batch) * cp_.local_seq_len()),
      layers_(spec, dims, placement, tp_.size()) {
  // The model's own rules (a chunk may hold no blocks: tests build such).
  XR_CHECK(dims.n_head >= 1 && (dims.head_dim > 0 || dims.d_model % dims.n_head == 0), spec.name, ": d_model ",
           dims.d_model, " % n_head ", dims.n_head, " with no head_dim");
  const std::string problem = decoder_layout_problem(spec, dims, ParallelLayout{1, tp_.size(), 1, 1});
  XR_CHECK(problem.empty(), spec.name, ": ", problem);
  XR_CHECK(batch.seq_len <= dims.max_seq_len, "seq_len ", batch.seq_len, " > max_seq_len ", dims.max_seq_len);
  XR_CHECK(spec.ffn != FfnKind::Moe || !batch.split_backward, spec.name,
           ": the mixture-of-experts layer has no split backward yet (a zero-bubble parallel.schedule)");
  ParamList list(tp_.size(), tp_.rank(), dtype_, wide_dtype_);
  layers_.declare(list);
  params_ = list.take();
  layers_.bind(params_);  // params_ does not grow again: the layers keep pointers into it
}

ActList DecoderChunk::block_activations(size_t l, BlockActs& a) const {
  const int64_t B = batch_.micro_batch, T = cp_.local_seq_len(), C = dims_.d_model;
  const int64_t N = tp_.rows(), R = tp_.local_rows();
  const DecoderLayers::Block& b = layers_.blocks[l];
  ActList list;
  b.norm1.activations(list, a.norm1, R, C, layers_.spec.names.norm1);
  b.attn.activations(list, a.attn, B, T);
  list.push_back({&a.res2, {R, C}, false, "residual 2", Keep::UnlessFull});
  b.norm2.activations(list, a.norm2, R, C, layers_.spec.names.norm2);
  b.ffn->activations(list, a.ffn, N, tp_.size(), dtype_);
  list.push_back({&a.res3, {R, C}, false, "block output", Keep::Always});
  return list;
}

bool DecoderChunk::in_input_slot(const ActSpec& e, const BlockActs& a) const {
  if (!batch_.split_backward || !kept(e.keep, batch_.recompute)) return false;
  if (e.tensor == &a.attn.y || e.tensor == &a.ffn.post) return true;
  return !tp_.sequence_parallel() && (e.tensor == &a.norm1.y || e.tensor == &a.norm2.y);
}

void DecoderChunk::layout_slot(Arena& acts, SlotActs& s, Pool pool) {
  const int64_t C = dims_.d_model, P = tp_.size(), N = tp_.rows(), R = tp_.local_rows();
  // The slot's tensors are carved one after another: [begin, end) holds them all.
  auto note = [&](const Tensor& t) {
    const char* p = static_cast<const char*>(t.raw());
    if (!p) return;
    if (!s.begin || p < s.begin) s.begin = p;
    if (!s.end || p + t.bytes() > s.end) s.end = p + t.bytes();
  };
  auto alloc = [&](const ActSpec& a) {
    *a.tensor = acts.alloc(a.shape, act_dtype(a), a.what);
    note(*a.tensor);
  };
  if (pool == Pool::Activation) {
    s.input = acts.alloc({R, C}, dtype_, "stage input");
    note(s.input);
  }
  s.blocks.resize(layers_.blocks.size());
  for (size_t l = 0; l < s.blocks.size(); ++l)
    for (const ActSpec& a : block_activations(l, s.blocks[l]))
      if (kept(a.keep, batch_.recompute) && in_input_slot(a, s.blocks[l]) == (pool == Pool::Input)) alloc(a);
  if (placement_.has_head && pool == Pool::Activation) {
    ActList list;
    layers_.final_norm->activations(list, s.final_norm, R, C, layers_.spec.names.final_norm);
    for (const ActSpec& a : list) alloc(a);
    s.logits = acts.alloc({N, dims_.padded_vocab() / P}, dtype_, "logits");
    s.losses = acts.alloc({N}, wide_dtype_, "losses");
    note(s.logits);
    note(s.losses);
  }
}

int64_t DecoderChunk::weight_queue_bytes() const {
  const int64_t C = dims_.d_model, N = tp_.rows();
  const int64_t e = int64_t(dtype_size(dtype_));
  std::vector<int64_t> pieces;
  for (size_t l = 0; l < layers_.blocks.size(); ++l) {
    // The products: qkv (dqkv, norm 1's output), proj (dy, attention
    // output), up (dpre, norm 2's output), down (dy, activation). Their
    // output gradients lie in backward scratch; an input lies in an input
    // slot, or is a recomputed or gathered copy (the norm outputs then
    // all N rows).
    BlockActs shapes;
    for (const ActSpec& a : block_activations(l, shapes)) {
      if (a.tensor == &shapes.attn.qkv || a.tensor == &shapes.ffn.pre) pieces.push_back(a.shape.numel() * e);
      const bool norm = a.tensor == &shapes.norm1.y || a.tensor == &shapes.norm2.y;
      if ((norm || a.tensor == &shapes.attn.y || a.tensor == &shapes.ffn.post) && !in_input_slot(a, shapes))
        pieces.push_back((norm ? N * C : a.shape.numel()) * e);
    }
    pieces.push_back(N * C * e);  // proj's dy
    pieces.push_back(N * C * e);  // down's dy
  }
  // The head's and the embedding's weight gradients are finished in the input part.
  return WeightGradQueue::bytes_for(pieces);
}

void DecoderChunk::layout_activations(Arena& acts) {
  const int64_t C = dims_.d_model, N = tp_.rows(), R = tp_.local_rows(), P = tp_.size();
  slots_.assign(size_t(batch_.activation_slots), {});
  for (auto& s : slots_) layout_slot(acts, s, Pool::Activation);
  inputs_.assign(batch_.split_backward ? size_t(batch_.inputs()) : 0, {});
  for (auto& s : inputs_) layout_slot(acts, s, Pool::Input);
  work_ = {};
  if (batch_.recompute != Recompute::None && !layers_.blocks.empty())
    for (const ActSpec& a : block_activations(0, work_))
      if (!kept(a.keep, batch_.recompute))
        *a.tensor = acts.alloc(a.shape, act_dtype(a), "recomputed " + a.what);
  tp_.layout(acts, C, dtype_);
  if (!layers_.blocks.empty()) {
    const CausalSelfAttention& attn = layers_.blocks[0].attn;
    cp_.layout(acts, attn.local_kv_width(), int64_t(attn.local_heads()) * attn.head_dim(), dtype_);
  }
  d_res_ = acts.alloc({R, C}, dtype_, "residual gradient");
  d_c_ = acts.alloc({R, C}, dtype_, "norm output gradient");
  int64_t width = 1;
  if (!layers_.blocks.empty()) {
    const CausalSelfAttention& attn = layers_.blocks[0].attn;
    const int64_t y = int64_t(attn.local_heads()) * attn.head_dim();
    width = std::max(layers_.blocks[0].ffn->scratch_width(int(P)), y + attn.local_qkv_width());
  }
  d_big_ = acts.alloc({N, width}, dtype_, "backward scratch");
  for (DecoderLayers::Block& b : layers_.blocks) b.ffn->layout_state(acts, N, cp_.local_seq_len(), dtype_);
  rope_ = RotaryTables{};
  rope_ready_ = false;
  if (layers_.spec.rotary && !layers_.blocks.empty()) {
    const int64_t half = layers_.spec.resolved_head_dim(dims_) / 2;
    rope_.cos = acts.alloc({batch_.seq_len, half}, wide_dtype_, "rotary cos");
    rope_.sin = acts.alloc({batch_.seq_len, half}, wide_dtype_, "rotary sin");
    rope_.seq_len = batch_.seq_len;
    rope_.split = cp_.context_split();
    rope_.cp_rank = cp_.rank();
  }
  if (layers_.head) layers_.head->layout(acts, tp_, wide_dtype_);
  if (placement_.has_head) loss_sum_ = acts.alloc({1}, DType::F64, "loss sum");
  loss_pending_ = false;
  later_.assign(batch_.split_backward ? size_t(batch_.weights()) : 0, {});
  later_storage_.clear();
  const int64_t words = std::max<int64_t>(1, weight_queue_bytes() / 4);
  for (size_t i = 0; i < later_.size(); ++i)
    later_storage_.push_back(acts.alloc({words}, DType::I32, "weight-gradient operands"));
}

DecoderChunk::BlockActs DecoderChunk::block_acts(const MicrobatchSlots& at, size_t l) const {
  BlockActs a = slots_.at(size_t(at.activation)).blocks[l];
  if (batch_.split_backward) {
    BlockActs in = inputs_.at(size_t(at.input)).blocks[l];
    const ActList mine = block_activations(l, a), kept_in = block_activations(l, in);
    for (size_t i = 0; i < mine.size(); ++i)
      if (in_input_slot(mine[i], a)) *mine[i].tensor = *kept_in[i].tensor;
  }
  if (batch_.recompute == Recompute::None) return a;
  BlockActs work = work_;
  const ActList mine = block_activations(l, a), shared = block_activations(l, work);
  for (size_t i = 0; i < mine.size(); ++i)
    if (!kept(mine[i].keep, batch_.recompute)) *mine[i].tensor = *shared[i].tensor;
  return a;
}

void DecoderChunk::recompute(const KernelContext& ctx, size_t l, const Tensor& x, BlockActs& a) {
  if (batch_.recompute == Recompute::None) return;
  const double t0 = now_seconds();
  const DecoderLayers::Block& b = layers_.blocks[l];
  if (batch_.recompute == Recompute::Full) {
    block_forward(ctx, b, x, a, /*whole=*/false);
  } else {
    b.attn.attend(ctx, a.attn.qkv, a.attn.lse, a.attn.y, &cp_);  // qkv holds q and k as forward left them
    for (const ActSpec& s : block_activations(l, a))
      if (s.tensor == &a.ffn.post && !kept(s.keep, Recompute::Selective)) b.ffn->recompute(ctx, a.ffn);
  }
  add_span(ctx.timeline, "recompute", Track::Main, t0, now_seconds());
}

void DecoderChunk::ensure_rope(const KernelContext& ctx) {
  if (rope_ready_ || !layers_.spec.rotary || layers_.blocks.empty()) return;
  rope_table(ctx, rope_.cos, rope_.sin, dims_.rope);
  rope_ready_ = true;
}

// ---- forward

void DecoderChunk::block_forward(const KernelContext& ctx, const DecoderLayers::Block& b, const Tensor& x,
                                 BlockActs& a, bool whole) {
  b.norm1.forward(ctx, a.norm1.y, a.norm1.mean, a.norm1.rstd, x);
  b.attn.forward(ctx, a.attn, tp_.gathered(a.norm1.y), rope(), &cp_);
  Tensor ln2 = a.norm2.y;
  if (tp_.split()) {
    b.attn.proj().forward(ctx, tp_, a.res2, a.attn.y.flat2d(), x);
    b.norm2.forward(ctx, a.norm2.y, a.norm2.mean, a.norm2.rstd, a.res2);
    ln2 = tp_.gathered(a.norm2.y);
  } else {
    // One rank: the bias rides on the product, the residual add on the norm.
    b.attn.proj().forward_unsplit(ctx, a.res2, a.attn.y.flat2d());
    b.norm2.residual_forward(ctx, a.res2, a.norm2.y, a.norm2.mean, a.norm2.rstd, a.res2, x);
  }
  if (whole) b.ffn->forward(ctx, tp_, a.res3, a.ffn, ln2, a.res2);
  else b.ffn->forward_hidden(ctx, a.ffn, ln2);
}

void DecoderChunk::head_forward(const KernelContext& ctx, SlotActs& s, const Tensor& x, const Tensor& targets,
                                double dloss) {
  check_shape((layers_.spec.name + "::forward").c_str(), "targets", targets,
              {batch_.micro_batch, cp_.local_seq_len()});
  const NormActs& f = s.final_norm;
  layers_.final_norm->forward(ctx, f.y, f.mean, f.rstd, x);
  layers_.head->forward(ctx, tp_, layers_.head_table(), s.logits, s.losses, tp_.gathered(f.y), targets, dloss);
  // The microbatch's mean loss joins the step's sum on the device: the host
  // reads it once, in take_loss().
  if (!loss_pending_) zero(ctx, loss_sum_);
  mean_accumulate(ctx, loss_sum_, s.losses);
  loss_pending_ = true;
}

double DecoderChunk::take_loss(const KernelContext& ctx) {
  if (!placement_.has_head || !loss_pending_) return 0.0;
  double sum = 0;
  copy_bytes(&sum, Device::CPU, loss_sum_.raw(), loss_sum_.device(), sizeof(double), ctx.cuda_stream, true);
  loss_pending_ = false;
  return sum;
}

void DecoderChunk::forward(const KernelContext& ctx, MicrobatchSlots slot, const Tensor& tokens,
                           const Tensor& targets, double dloss) {
  XR_CHECK(tp_.can_run(), layers_.spec.name, ": a chunk laid out without its tensor-parallel group cannot run");
  XR_CHECK(cp_.can_run(), layers_.spec.name, ": a chunk laid out without its context-parallel group cannot run");
  tp_.begin_pass(ctx);
  cp_.begin_pass(ctx);
  ensure_rope(ctx);
  for (const DecoderLayers::Block& b : layers_.blocks) b.ffn->begin_forward(dloss);
  SlotActs& s = slots_.at(size_t(slot.activation));
  if (placement_.has_embedding) {
    check_shape((layers_.spec.name + "::forward").c_str(), "tokens", tokens,
                {batch_.micro_batch, cp_.local_seq_len()});
    layers_.embed->forward(ctx, tp_, s.input, tokens);
    if (layers_.positions)
      layers_.positions->forward(ctx, s.input, cp_.context_split(), cp_.rank(),
                                 tp_.sequence_parallel() ? tp_.rank() * tp_.local_rows() : 0);
  }
  const Tensor* x = &s.input;
  for (size_t l = 0; l < layers_.blocks.size(); ++l) {
    BlockActs a = block_acts(slot, l);
    block_forward(ctx, layers_.blocks[l], *x, a);
    x = &s.blocks[l].res3;
  }
  if (placement_.has_head) head_forward(ctx, s, *x, targets, dloss);
}

// ---- backward: the mirror of forward

// Residual adds need no op: the gradient passes through d_res_ and the norm
// backward passes accumulate into it. Each layer's backward computes its
// input gradient and its weight gradients together (Linear::backward), or,
// in a split backward's input part, its input gradient, bias and norm
// gradients, and leaves the weight products to the weight slot's
// WeightGradQueue (models/layers/weight_grads.h) for the weight part, which
// reads their layer inputs from the microbatch's input slot. The head's
// and the embedding's weight gradients are finished in the input part: W
// would otherwise hold the logits' gradient (N x vocabulary) and the
// embedding's, and they are the first and last products of the fused
// pass, so the order of every parameter's accumulation is the same.
void DecoderChunk::block_backward(const KernelContext& ctx, const DecoderLayers::Block& b, const Tensor& x,
                                  BlockActs& a, GradPhase phase, WeightGradQueue* later) {
  const int64_t N = tp_.rows(), Y = a.attn.y.size(2), Q = a.attn.qkv.size(2);
  const Tensor flat = d_big_.flat();
  const Tensor dy_attn = flat.flat_range(0, N * Y).view({N, Y});                // (N, H D/P)
  const Tensor dqkv = flat.flat_range(N * Y, N * (Y + Q)).view(a.attn.qkv.shape());  // (B, T, qkv width)

  Tensor dy = tp_.full_rows(d_res_);
  b.ffn->backward(ctx, tp_, d_big_, dy, a.ffn, tp_.gathered(a.norm2.y), later);
  b.norm2.backward(ctx, d_res_, ColumnParallelLinear::input_grad(tp_, d_c_), a.res2, a.norm2.mean, a.norm2.rstd);

  dy = tp_.full_rows(d_res_);
  b.attn.proj().backward(ctx, dy_attn, dy, a.attn.y.flat2d(), later);
  b.attn.backward(ctx, tp_, dqkv, dy_attn.view(a.attn.y.shape()), a.attn, tp_.gathered(a.norm1.y), rope(), later,
                  &cp_);
  b.norm1.backward(ctx, d_res_, ColumnParallelLinear::input_grad(tp_, d_c_), x, a.norm1.mean, a.norm1.rstd);
  if (phase == GradPhase::Final) {
    b.attn.reduce_grads(tp_);
    b.norm1.reduce_grads(tp_);
    b.norm2.reduce_grads(tp_);
  }
}

void DecoderChunk::head_backward(const KernelContext& ctx, SlotActs& s, GradPhase phase) {
  // The training forward left dlogits in s.logits.
  const Tensor& last = layers_.blocks.empty() ? s.input : s.blocks.back().res3;
  const NormActs& f = s.final_norm;
  layers_.head->backward(ctx, tp_, layers_.head_table(), s.logits, tp_.gathered(f.y));
  Tensor dnorm = tp_.partial();
  if (tp_.split()) {
    tp_.reduce_rows(tp_.partial(), tp_.sequence_parallel() ? d_c_ : tp_.partial());
    if (tp_.sequence_parallel()) dnorm = d_c_;
  }
  zero(ctx, d_res_);
  layers_.final_norm->backward(ctx, d_res_, dnorm, last, f.mean, f.rstd);
  if (phase == GradPhase::Final) layers_.final_norm->reduce_grads(tp_);
}

Tensor DecoderChunk::stage_output(int slot) {
  SlotActs& s = slots_.at(size_t(slot));
  return layers_.blocks.empty() ? s.input : s.blocks.back().res3;
}

void DecoderChunk::embedding_backward(const KernelContext& ctx, const Tensor& dy_full, const Tensor& tokens) const {
  layers_.embed->backward(ctx, tp_, dy_full, tokens);
  if (layers_.positions) layers_.positions->backward(ctx, dy_full, cp_.context_split(), cp_.rank());
}

void DecoderChunk::backward(const KernelContext& ctx, MicrobatchSlots slot, const Tensor& tokens, GradPhase phase,
                            const Tensor& output_grad, BackwardPart part) {
  XR_CHECK(part == BackwardPart::Full || splits_backward(), layers_.spec.name,
           ": a split backward needs a chunk laid out with ChunkBatch::split_backward");
  XR_CHECK(tp_.can_run(), layers_.spec.name, ": a chunk laid out without its tensor-parallel group cannot run");
  XR_CHECK(cp_.can_run(), layers_.spec.name, ": a chunk laid out without its context-parallel group cannot run");
  if (part == BackwardPart::WeightGrad) {
    later_.at(size_t(slot.weight)).run(ctx, [this](int layer) { grad_ready(layer); });
    return;
  }
  WeightGradQueue* later = part == BackwardPart::InputGrad ? &later_.at(size_t(slot.weight)) : nullptr;
  XR_CHECK(!later || !later->pending(), layers_.spec.name, ": weight slot ", slot.weight,
           "'s weight-gradient part has not run since its last input-gradient part");
  // The queue references the layer inputs in the microbatch's input slot and copies every other operand.
  if (later)
    later->bind(later_storage_.at(size_t(slot.weight)), inputs_.at(size_t(slot.input)).begin,
                inputs_.at(size_t(slot.input)).end);
  // Where the fused pass calls grad_ready, a split one marks the place in the queue.
  const bool final_pass = phase == GradPhase::Final;
  auto ready = [&](int layer) {
    if (!final_pass) return;
    if (later) later->layer_done(layer);
    else grad_ready(layer);
  };
  tp_.begin_pass(ctx);
  cp_.begin_pass(ctx);
  SlotActs& s = slots_.at(size_t(slot.activation));
  if (placement_.has_head) {
    head_backward(ctx, s, phase);
    ready(dims_.n_layer);
  } else {
    check_shape((layers_.spec.name + "::backward").c_str(), "output_grad", output_grad, d_res_.shape());
    copy_tensor(d_res_, output_grad, ctx.cuda_stream, false);  // in stream order on a device
  }
  for (int l = int(layers_.blocks.size()) - 1; l >= 0; --l) {
    const Tensor& x = l == 0 ? s.input : s.blocks[size_t(l - 1)].res3;
    BlockActs a = block_acts(slot, size_t(l));
    recompute(ctx, size_t(l), x, a);
    block_backward(ctx, layers_.blocks[size_t(l)], x, a, phase, later);
    ready(placement_.first_layer + l);
  }
  if (placement_.has_embedding) {
    // Every rank needs the gradient of all N rows: its table shard serves tokens from any row.
    embedding_backward(ctx, tp_.full_rows(d_res_), tokens);
    ready(-1);
  }
}

double DecoderChunk::take_aux_loss() {
  double sum = 0;
  for (DecoderLayers::Block& b : layers_.blocks) sum += b.ffn->take_aux_loss();
  return sum;
}

void DecoderChunk::end_step(const KernelContext& ctx) {
  for (DecoderLayers::Block& b : layers_.blocks) b.ffn->end_step(ctx);
}

double DecoderChunk::flops_per_token() const {
  const DecoderSpec& spec = layers_.spec;
  const double L = dims_.n_layer, C = dims_.d_model, T = batch_.seq_len;
  const double D = spec.resolved_head_dim(dims_), H = dims_.n_head, KV = dims_.kv_heads(), F = spec.ffn_hidden;
  const double ffn_matrices = spec.ffn == FfnKind::SwiGlu ? 3.0 : 2.0;
  // q and o: C x H D each; k and v: C x KV D each; the feed-forward's C x F matrices.
  double per_layer = 2.0 * C * H * D + 2.0 * C * KV * D + ffn_matrices * C * F;
  if (spec.ffn == FfnKind::Moe && !layers_.blocks.empty())  // the active experts, shared experts and router
    per_layer = 2.0 * C * H * D + 2.0 * C * KV * D +
                static_cast<const MoeFeedForward&>(*layers_.blocks[0].ffn).active_matrix_params();
  const double matrix_params = L * per_layer + double(dims_.padded_vocab()) * C;
  // Attention scores and values: 4 T H D per layer forward over the query heads, whatever KV.
  return 6.0 * matrix_params + 12.0 * L * H * D * T;
}

}  // namespace xirang
