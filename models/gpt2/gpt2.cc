#include "models/gpt2/gpt2.h"

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
#include "models/gpt2/gpt2_files.h"

namespace xirang {

namespace {

// Megatron's split of each block over P tensor-parallel ranks: the QKV and
// MLP up-projections column-parallel (rows split; QKV in its three blocks),
// the output projections row-parallel (columns split), the token table
// vocabulary-parallel; norms, biases of row-parallel outputs and the
// position table replicated.
class ParamList {
 public:
  ParamList(const ModelDims& d, int tp, int tp_rank, DType dt, DType gdt) : d_(d), P_(tp), rank_(tp_rank), dt_(dt), gdt_(gdt) {}
  void add(const std::string& name, ShardSpec shard, bool decay, int layer, InitRule init) {
    const Shape local = shard_local(shard);
    out.push_back({name, Tensor(nullptr, local, dt_), Tensor(nullptr, local, gdt_), decay, layer, std::move(shard),
                   false, false, init});
  }
  ShardSpec rep(Shape g) const { return ShardSpec::whole(g); }
  ShardSpec split(Shape g, int dim, int blocks = 1) const { return ShardSpec::split(g, dim, P_, rank_, blocks); }
  std::vector<Parameter> out;

 private:
  static Shape shard_local(const ShardSpec& s) {
    Shape local = s.global;
    if (!s.replicated()) local[s.dim] /= s.parts;
    return local;
  }
  const ModelDims& d_;
  int P_, rank_;
  DType dt_, gdt_;
};

void add_block(ParamList& L, const ModelDims& d, int l) {
  const int64_t C = d.d_model;
  const std::string p = "h." + std::to_string(l) + ".";
  const InitRule w = InitRule::normal(0.02), zeros = InitRule::zeros(), ones = InitRule::ones();
  const InitRule proj = InitRule::scaled_residual(0.02, d.n_layer);
  L.add(p + "ln_1.weight", L.rep({C}), false, l, ones);
  L.add(p + "ln_1.bias", L.rep({C}), false, l, zeros);
  L.add(p + "attn.c_attn.weight", L.split({3 * C, C}, 0, 3), true, l, w);
  L.add(p + "attn.c_attn.bias", L.split({3 * C}, 0, 3), false, l, zeros);
  L.add(p + "attn.c_proj.weight", L.split({C, C}, 1), true, l, proj);
  L.add(p + "attn.c_proj.bias", L.rep({C}), false, l, zeros);
  L.add(p + "ln_2.weight", L.rep({C}), false, l, ones);
  L.add(p + "ln_2.bias", L.rep({C}), false, l, zeros);
  L.add(p + "mlp.c_fc.weight", L.split({4 * C, C}, 0), true, l, w);
  L.add(p + "mlp.c_fc.bias", L.split({4 * C}, 0), false, l, zeros);
  L.add(p + "mlp.c_proj.weight", L.split({C, 4 * C}, 1), true, l, proj);
  L.add(p + "mlp.c_proj.bias", L.rep({C}), false, l, zeros);
}

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

std::vector<Parameter> gpt2_parameters(const ModelDims& d, const ChunkPlacement& at, int tp, int tp_rank, DType dtype,
                                       DType grad_dtype) {
  const int64_t C = d.d_model, Vp = d.padded_vocab();
  ParamList L(d, tp, tp_rank, dtype, grad_dtype);
  // The token table is tied to the head: the first chunk holds it for the
  // input, the last chunk a copy for the head. Its padding rows stay zero:
  // no token selects them and their logits are ignored.
  if (at.has_embedding || at.has_head) {
    L.add("wte.weight", L.split({Vp, C}, 0), true, -1, InitRule::normal(0.02, int64_t(d.vocab_size) * C));
    L.out.back().tied = !(at.has_embedding && at.has_head);
    L.out.back().tied_copy = !at.has_embedding;
  }
  if (at.has_embedding) L.add("wpe.weight", L.rep({d.max_seq_len, C}), true, -1, InitRule::normal(0.01));
  for (int l = at.first_layer; l < at.end_layer; ++l) add_block(L, d, l);
  if (at.has_head) {
    L.add("ln_f.weight", L.rep({C}), false, d.n_layer, InitRule::ones());
    L.add("ln_f.bias", L.rep({C}), false, d.n_layer, InitRule::zeros());
  }
  return std::move(L.out);
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

GPT2::GPT2(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch,
           const TensorParallel& parallel)
    : ModelChunk(dims, placement, dtype, batch), par_(parallel) {
  if (par_.group) {
    tp_size_ = par_.group->size();
    tp_rank_ = par_.group->rank();
  } else if (par_.size > 1) {
    XR_CHECK(0 <= par_.rank && par_.rank < par_.size, "GPT2: tensor-parallel rank ", par_.rank, " of ", par_.size);
    tp_size_ = par_.size;
    tp_rank_ = par_.rank;
  }
  const int P = tp_size_;
  // In a group of one there is nothing to split: run the plain single-rank path.
  if (P == 1) par_.sequence_parallel = false;
  // The architecture's own rules (a chunk may hold no blocks: tests build such).
  XR_CHECK(dims.n_head >= 1 && dims.d_model % dims.n_head == 0, "GPT2: d_model ", dims.d_model, " % n_head ",
           dims.n_head);
  const std::string problem = gpt2_layout_problem(dims, ParallelLayout{1, P, 1, 1});
  XR_CHECK(problem.empty(), "GPT2: ", problem);
  XR_CHECK(batch.seq_len <= dims.max_seq_len, "seq_len ", batch.seq_len, " > max_seq_len ", dims.max_seq_len);
  rows_ = int64_t(batch.micro_batch) * batch.seq_len;
  local_rows_ = par_.sequence_parallel ? rows_ / P : rows_;
  XR_CHECK(!par_.sequence_parallel || rows_ % P == 0, "sequence parallelism needs B*T ", rows_, " divisible by tp ", P);

  params_ = gpt2_parameters(dims, placement, P, tp_rank_, dtype_, wide_dtype_);
  // Pointers into params_ are kept below; its storage never moves again.
  Parameter* p = params_.data();
  if (placement.has_embedding || placement.has_head) wte_ = p++;
  if (placement.has_embedding) wpe_ = p++;
  for (int l = placement.first_layer; l < placement.end_layer; ++l) {
    BlockParams b;
    for (Parameter** f : {&b.ln1_w, &b.ln1_b, &b.qkv_w, &b.qkv_b, &b.attn_w, &b.attn_b, &b.ln2_w, &b.ln2_b, &b.fc_w,
                          &b.fc_b, &b.proj_w, &b.proj_b})
      *f = p++;
    blocks_.push_back(b);
  }
  if (placement.has_head) {
    lnf_w_ = p++;
    lnf_b_ = p++;
  }
  XR_CHECK(p == params_.data() + params_.size(), "GPT2: parameter list and block layout disagree");
}

void GPT2::layout_activations(Arena& acts) {
  const int64_t B = batch_.micro_batch, T = batch_.seq_len, C = dims_.d_model, P = tp_size_;
  const int64_t N = rows_, R = local_rows_, Hp = dims_.n_head / P, Cp = C / P;
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
    if (placement_.has_head) {
      s.lnf = A({R, C}, "ln_f output");
      s.lnf_mean = W({R}, "ln_f mean");
      s.lnf_rstd = W({R}, "ln_f rstd");
      s.logits = A({N, dims_.padded_vocab() / P}, "logits");
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
  if (placement_.has_head && P > 1) {
    ce_max_ = W({N}, "softmax row max");
    ce_sums_ = W({N, 2}, "softmax sums");
  }
  if (placement_.has_head) loss_sum_ = acts.alloc({1}, DType::F64, "loss sum");
  loss_pending_ = false;
}

// ---- tensor-parallel communication (each a no-op in a group of one)

void GPT2::tp_all_reduce(Tensor t, ReduceOp op) {
  if (tp_size_ == 1) return;
  Stopwatch sw;
  par_.group->all_reduce_async(t, op)->join(stream_);
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
  par_.group->all_gather_async(local, ln_full_)->join(stream_);
  tp_comm_ms_ += sw.ms();
  return ln_full_;
}

void GPT2::reduce_rows(Tensor partial, Tensor out) {
  if (tp_size_ == 1) return;
  Stopwatch sw;
  WorkPtr w = par_.sequence_parallel ? par_.group->reduce_scatter_async(partial, out, ReduceOp::Sum)
                                     : par_.group->all_reduce_async(partial, ReduceOp::Sum);
  w->join(stream_);
  tp_comm_ms_ += sw.ms();
}

Tensor GPT2::full_rows(Tensor local) {
  if (!par_.sequence_parallel) return local;
  Stopwatch sw;
  par_.group->all_gather_async(local, d_full_)->join(stream_);
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
  flash_attention_forward(ctx, a.atty, a.lse, a.qkv, dims_.n_head / tp_size_);
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
    cross_entropy_forward_backward(ctx, s.losses, dlogits, s.logits, tg, dims_.vocab_size, dloss);
  } else {
    // Vocabulary-parallel softmax: only (N) and (N, 2) statistics cross ranks.
    const int64_t vb = int64_t(tp_rank_) * (dims_.padded_vocab() / tp_size_);
    cross_entropy_shard_max(ctx, ce_max_, s.logits, vb, dims_.vocab_size);
    tp_all_reduce(ce_max_, ReduceOp::Max);
    cross_entropy_shard_sums(ctx, ce_sums_, s.logits, tg, ce_max_, vb, dims_.vocab_size);
    tp_all_reduce(ce_sums_, ReduceOp::Sum);
    cross_entropy_shard_finish(ctx, s.losses, dlogits, s.logits, tg, ce_max_, ce_sums_, vb, dims_.vocab_size, dloss);
  }
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
  XR_CHECK(tp_size_ == 1 || par_.group, "GPT2: a chunk laid out without its tensor-parallel group cannot run");
  stream_ = ctx.cuda_stream;
  SlotActs& s = slots_.at(size_t(slot));
  const int64_t T = batch_.seq_len;
  if (placement_.has_embedding) {
    check_shape("GPT2::forward", "tokens", tokens, {batch_.micro_batch, batch_.seq_len});
    const int64_t vb = int64_t(tp_rank_) * (dims_.padded_vocab() / tp_size_);
    const Tensor tk = tokens.view({rows_});
    // Vocabulary-parallel lookup: rows of tokens another rank holds are zero here.
    Tensor dst = par_.sequence_parallel ? partial_ : s.input;
    embedding_lookup(ctx, dst, tk, wte_->value, vb, dims_.vocab_size);
    reduce_rows(dst, s.input);
    add_positions(ctx, s.input, wpe_->value, T, par_.sequence_parallel ? int64_t(tp_rank_) * local_rows_ : 0);
  }
  const Tensor* x = &s.input;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    block_forward(ctx, int(l), *x, s.blocks[l]);
    x = &s.blocks[l].res3;
  }
  if (!placement_.has_head) return;
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
  const int64_t N = rows_, Cp = dims_.d_model / tp_size_;
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
  flash_attention_backward(ctx, dqkv, datty.view(a.atty.shape()), a.qkv, a.atty, a.lse, dims_.n_head / tp_size_);
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
                    const Tensor& output_grad, BackwardPart part) {
  XR_CHECK(part == BackwardPart::Full, "GPT2 runs the whole backward pass in one part (splits_backward() is false)");
  XR_CHECK(tp_size_ == 1 || par_.group, "GPT2: a chunk laid out without its tensor-parallel group cannot run");
  stream_ = ctx.cuda_stream;
  SlotActs& s = slots_.at(size_t(slot));
  const bool final_pass = phase == GradPhase::Final;
  auto ready = [&](int layer) {
    if (final_pass) grad_ready(layer);
  };
  if (placement_.has_head) {
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
    ready(dims_.n_layer);
  } else {
    check_shape("GPT2::backward", "output_grad", output_grad, d_res_.shape());
    copy_tensor(d_res_, output_grad, ctx.cuda_stream, false);  // in stream order on a device
  }
  for (int l = int(blocks_.size()) - 1; l >= 0; --l) {
    const Tensor& x = l == 0 ? s.input : s.blocks[size_t(l - 1)].res3;
    block_backward(ctx, l, x, s.blocks[size_t(l)], phase);
    ready(placement_.first_layer + l);
  }
  if (placement_.has_embedding) {
    // Every rank needs the gradient of all N rows: its table shard serves tokens from any row.
    Tensor dy = full_rows(d_res_);
    const int64_t vb = int64_t(tp_rank_) * (dims_.padded_vocab() / tp_size_);
    embedding_lookup_backward(ctx, wte_->grad, dy, tokens.view({rows_}), vb, dims_.vocab_size);
    add_positions_backward(ctx, wpe_->grad, dy, batch_.seq_len, 0);
    ready(-1);
  }
}

double GPT2::flops_per_token() const {
  const double L = dims_.n_layer, C = dims_.d_model, T = batch_.seq_len;
  const double matrix_params = L * 12.0 * C * C + double(dims_.padded_vocab()) * C;
  return 6.0 * matrix_params + 12.0 * L * C * T;
}

}  // namespace xirang
