#include "models/layers/attention.h"

#include "core/error.h"
#include "kernels/attention.h"
#include "kernels/cp_attention.h"
#include "kernels/qk_norm.h"
#include "kernels/rope.h"

namespace xirang {

CausalSelfAttention::CausalSelfAttention(int n_head, int n_kv_head, int head_dim, int tp, AttnOptions options)
    : n_head_(n_head),
      n_kv_head_(n_kv_head),
      head_dim_(head_dim),
      tp_(tp),
      local_heads_(n_head / tp),
      local_kv_heads_(n_kv_head / tp),
      options_(options) {
  XR_CHECK(n_kv_head > 0 && n_head % n_kv_head == 0, "attention: n_kv_head ", n_kv_head, " must divide n_head ",
           n_head);
  XR_CHECK(n_head % tp == 0 && n_kv_head % tp == 0, "attention: tp ", tp, " must divide n_head ", n_head,
           " and n_kv_head ", n_kv_head);
}

void CausalSelfAttention::declare(ParamList& list, const AttnNames& names, int64_t width, int layer,
                                  InitRule qkv_init, InitRule proj_init) {
  const int64_t q = int64_t(n_head_) * head_dim_, kv = int64_t(n_kv_head_) * head_dim_;
  qkv_.declare(list, names.qkv, {q, kv, kv}, width, layer, qkv_init, options_.bias);
  if (options_.qk_norm) {
    q_norm_ref_ = list.add(names.q_norm + ".weight", list.whole({head_dim_}), false, layer, InitRule::ones());
    k_norm_ref_ = list.add(names.k_norm + ".weight", list.whole({head_dim_}), false, layer, InitRule::ones());
  }
  proj_.declare(list, names.proj, width, q, layer, proj_init, options_.bias);
}

void CausalSelfAttention::bind(std::vector<Parameter>& params) {
  qkv_.bind(params);
  if (options_.qk_norm) {
    q_norm_ = &q_norm_ref_.in(params);
    k_norm_ = &k_norm_ref_.in(params);
  }
  proj_.bind(params);
}

void CausalSelfAttention::activations(ActList& list, AttnActs& a, int64_t batch, int64_t seq_len) const {
  if (options_.qk_norm) {
    list.push_back({&a.qkv_raw, {batch, seq_len, local_qkv_width()}, false, "qkv before the q/k norm",
                    Keep::UnlessFull});
    list.push_back({&a.qk_rstd, {batch, seq_len, int64_t(local_heads_ + local_kv_heads_)}, true, "q/k norm rstd",
                    Keep::UnlessFull});
  }
  list.push_back({&a.qkv, {batch, seq_len, local_qkv_width()}, false, "qkv", Keep::UnlessFull});
  list.push_back({&a.lse, {batch, local_heads_, seq_len}, true, "attention log-sum-exp", Keep::UnlessSelective});
  list.push_back({&a.y, {batch, seq_len, int64_t(local_heads_) * head_dim_}, false, "attention output",
                  Keep::UnlessSelective});
}

int64_t CausalSelfAttention::local_qkv_width() const {
  return (int64_t(n_head_) + 2 * int64_t(n_kv_head_)) * head_dim_ / tp_;
}

namespace {

// The rotation of q and k at each row's position: the whole sequence's rows
// in order, or a context-parallel rank's share of it.
void rotate(const KernelContext& ctx, Tensor qkv, const RotaryTables& rope, int H, int KV, bool backward) {
  if (rope.split.ranks > 1) {
    if (backward) rope_qkv_backward(ctx, qkv, rope.cos, rope.sin, H, KV, rope.split, rope.cp_rank);
    else rope_qkv_forward(ctx, qkv, rope.cos, rope.sin, H, KV, rope.split, rope.cp_rank);
  } else if (backward) {
    rope_qkv_backward(ctx, qkv, rope.cos, rope.sin, H, KV, rope.seq_len, 0);
  } else {
    rope_qkv_forward(ctx, qkv, rope.cos, rope.sin, H, KV, rope.seq_len, 0);
  }
}

}  // namespace

void CausalSelfAttention::forward(const KernelContext& ctx, AttnActs& a, const Tensor& x_full,
                                  const RotaryTables* rope, CpComm* cp) const {
  if (options_.qk_norm) {
    qkv_.forward(ctx, a.qkv_raw.flat2d(), x_full);
    normalize_qk(ctx, a.qkv, a.qk_rstd, a.qkv_raw);
  } else {
    qkv_.forward(ctx, a.qkv.flat2d(), x_full);
  }
  if (rope) rotate(ctx, a.qkv, *rope, local_heads_, local_kv_heads_, /*backward=*/false);
  attend(ctx, a.qkv, a.lse, a.y, cp);
}

void CausalSelfAttention::normalize_qk(const KernelContext& ctx, Tensor out, Tensor rstd, const Tensor& raw) const {
  XR_CHECK(options_.qk_norm, "attention: normalize_qk without a q/k norm");
  qk_rmsnorm_forward(ctx, out, rstd, raw, q_norm_->value, k_norm_->value, local_heads_, local_kv_heads_,
                     options_.qk_eps);
}

void CausalSelfAttention::attend(const KernelContext& ctx, const Tensor& qkv, Tensor lse, Tensor y,
                                 CpComm* cp) const {
  if (cp && cp->split() && cp->ring()) {
    cp->ring_forward(ctx, y, lse, qkv, local_heads_, local_kv_heads_);
  } else if (cp && cp->split()) {
    const Tensor kv_all = cp->gather_kv(ctx, qkv, local_heads_, local_kv_heads_);
    cp_attention_forward(ctx, y, lse, qkv, kv_all, cp->context_split(), cp->rank(), local_heads_, local_kv_heads_);
  } else {
    flash_attention_forward(ctx, y, lse, qkv, local_heads_, local_kv_heads_);
  }
}

void CausalSelfAttention::backward(const KernelContext& ctx, TpComm& tp, Tensor dqkv, const Tensor& dy,
                                   const AttnActs& a, const Tensor& x_full, const RotaryTables* rope,
                                   WeightGradQueue* later, CpComm* cp) const {
  if (cp && cp->split() && cp->ring()) {
    cp->ring_backward(ctx, dqkv, dy, a.qkv, a.y, a.lse, local_heads_, local_kv_heads_);
  } else if (cp && cp->split()) {
    const Tensor kv_all = cp->gather_kv(ctx, a.qkv, local_heads_, local_kv_heads_);
    cp_attention_backward(ctx, dqkv, cp->kv_grad(), dy, a.qkv, kv_all, a.y, a.lse, cp->context_split(), cp->rank(),
                          local_heads_, local_kv_heads_);
    cp->reduce_kv_grad(ctx, dqkv, local_heads_, local_kv_heads_);
  } else {
    flash_attention_backward(ctx, dqkv, dy, a.qkv, a.y, a.lse, local_heads_, local_kv_heads_);
  }
  if (rope) rotate(ctx, dqkv, *rope, local_heads_, local_kv_heads_, /*backward=*/true);
  if (options_.qk_norm)  // in place: dqkv becomes the gradient of the projection's output
    qk_rmsnorm_backward(ctx, dqkv, q_norm_->grad, k_norm_->grad, dqkv, a.qkv_raw, q_norm_->value, k_norm_->value,
                        a.qk_rstd, local_heads_, local_kv_heads_, GradMode::Overwrite);
  qkv_.backward(ctx, tp.partial(), dqkv.flat2d(), x_full, later);
}

void CausalSelfAttention::reduce_grads(TpComm& tp) const {
  if (!options_.qk_norm || !tp.split()) return;
  tp.all_reduce(q_norm_->grad, ReduceOp::Sum);
  tp.all_reduce(k_norm_->grad, ReduceOp::Sum);
}

}  // namespace xirang
