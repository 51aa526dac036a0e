#include "models/layers/attention.h"

#include "core/error.h"
#include "kernels/attention.h"
#include "kernels/rope.h"

namespace xirang {

CausalSelfAttention::CausalSelfAttention(int n_head, int n_kv_head, int head_dim, int tp)
    : n_head_(n_head),
      n_kv_head_(n_kv_head),
      head_dim_(head_dim),
      tp_(tp),
      local_heads_(n_head / tp),
      local_kv_heads_(n_kv_head / tp) {
  XR_CHECK(n_kv_head > 0 && n_head % n_kv_head == 0, "attention: n_kv_head ", n_kv_head, " must divide n_head ",
           n_head);
  XR_CHECK(n_head % tp == 0 && n_kv_head % tp == 0, "attention: tp ", tp, " must divide n_head ", n_head,
           " and n_kv_head ", n_kv_head);
}

void CausalSelfAttention::declare(ParamList& list, const std::string& qkv_name, const std::string& proj_name,
                                  int64_t width, int layer, InitRule qkv_init, InitRule proj_init, bool bias) {
  const int64_t q = int64_t(n_head_) * head_dim_, kv = int64_t(n_kv_head_) * head_dim_;
  qkv_.declare(list, qkv_name, {q, kv, kv}, width, layer, qkv_init, bias);
  proj_.declare(list, proj_name, width, q, layer, proj_init, bias);
}

void CausalSelfAttention::bind(std::vector<Parameter>& params) {
  qkv_.bind(params);
  proj_.bind(params);
}

void CausalSelfAttention::activations(ActList& list, AttnActs& a, int64_t batch, int64_t seq_len) const {
  list.push_back({&a.qkv, {batch, seq_len, local_qkv_width()}, false, "qkv", Keep::UnlessFull});
  list.push_back({&a.lse, {batch, local_heads_, seq_len}, true, "attention log-sum-exp", Keep::UnlessSelective});
  list.push_back({&a.y, {batch, seq_len, int64_t(local_heads_) * head_dim_}, false, "attention output",
                  Keep::UnlessSelective});
}

int64_t CausalSelfAttention::local_qkv_width() const {
  return (int64_t(n_head_) + 2 * int64_t(n_kv_head_)) * head_dim_ / tp_;
}

void CausalSelfAttention::forward(const KernelContext& ctx, Tensor qkv, Tensor lse, Tensor y,
                                  const Tensor& x_full, const RotaryTables* rope) const {
  qkv_.forward(ctx, qkv.flat2d(), x_full);
  if (rope) rope_qkv_forward(ctx, qkv, rope->cos, rope->sin, local_heads_, local_kv_heads_, rope->seq_len, 0);
  attend(ctx, qkv, lse, y);
}

void CausalSelfAttention::attend(const KernelContext& ctx, const Tensor& qkv, Tensor lse, Tensor y) const {
  flash_attention_forward(ctx, y, lse, qkv, local_heads_, local_kv_heads_);
}

void CausalSelfAttention::backward(const KernelContext& ctx, TpComm& tp, Tensor dqkv, const Tensor& dy,
                                   const Tensor& qkv, const Tensor& y, const Tensor& lse, const Tensor& x_full,
                                   const RotaryTables* rope) const {
  flash_attention_backward(ctx, dqkv, dy, qkv, y, lse, local_heads_, local_kv_heads_);
  if (rope) rope_qkv_backward(ctx, dqkv, rope->cos, rope->sin, local_heads_, local_kv_heads_, rope->seq_len, 0);
  qkv_.backward(ctx, tp.partial(), dqkv.flat2d(), x_full);
}

}  // namespace xirang
