// models/layers/attention.h: causal self-attention, split by heads over the
// tensor-parallel group.
//
// The fused QKV projection is column-parallel in three blocks (q: n_head x
// head_dim rows, k and v: n_kv_head x head_dim rows each), so a rank holds
// the q, k and v rows of its heads; the output projection is row-parallel.
// The attention itself is causal flash attention over the rank's heads,
// keeping only the log-sum-exp for backward. With grouped-query attention
// (n_kv_head < n_head, dividing it) a rank's n_head / P query heads share its
// n_kv_head / P key/value heads; the kernel sees the rank's slice as a whole
// attention in the same packed layout. With rotary tables (LLaMA) the q and
// k heads of qkv are rotated in place between the projection and the
// attention (kernels/rope.h), so qkv holds them rotated; backward rotates
// their gradient back before the projection's backward. head_dim is the
// attention's own: it may differ from d_model / n_head (the projections map
// d_model to n_head x head_dim and back). A per-head q/k norm (Qwen3) would
// run in forward() between the projection and the rotation, and mirror in
// backward() between the rotation's backward and the projection's.
//
//   CausalSelfAttention attn(n_head, n_kv_head, head_dim, tp_size);
//   attn.declare(list, "h.0.attn.c_attn", "h.0.attn.c_proj", C, 0, InitRule::normal(0.02),
//                InitRule::scaled_residual(0.02, L));
//   attn.bind(params);
//   attn.forward(ctx, qkv, lse, y, x_full);       // y (B, T, C/P) before the output projection
//   attn.proj().forward(ctx, tp, out, y.flat2d(), /*skip=*/x);
#pragma once

#include <string>
#include <vector>

#include "models/layers/activation.h"
#include "models/layers/linear.h"

namespace xirang {

// Rotary position tables cos, sin (T, head_dim / 2) for positions 0..T-1
// (kernels/rope.h's rope_table), and the sequence length of the rows.
struct RotaryTables {
  Tensor cos, sin;
  int64_t seq_len = 0;
};

// What attention keeps for its backward.
struct AttnActs {
  Tensor qkv;  // (B, T, local_qkv_width()) after the projection (q and k rotated with rotary tables)
  Tensor lse;  // (B, H/P, T) log-sum-exp of the flash attention
  Tensor y;    // (B, T, H head_dim / P) attention output before the output projection
};

class CausalSelfAttention {
 public:
  CausalSelfAttention(int n_head, int n_kv_head, int head_dim, int tp);
  // `bias`: the projections have biases (GPT-2) or not (LLaMA).
  void declare(ParamList& list, const std::string& qkv_name, const std::string& proj_name, int64_t width, int layer,
               InitRule qkv_init, InitRule proj_init, bool bias = true);
  void bind(std::vector<Parameter>& params);
  int local_heads() const { return local_heads_; }
  int head_dim() const { return head_dim_; }
  // qkv kept unless full recomputation; lse and y rebuilt by selective recomputation (attend()).
  void activations(ActList& list, AttnActs& a, int64_t batch, int64_t seq_len) const;
  // Columns of this rank's fused q, k, v rows: (H + 2 Hkv) head_dim / P.
  int64_t local_qkv_width() const;
  const RowParallelLinear& proj() const { return proj_; }
  // The fused q/k/v projection (generation runs it on its own rows: models/decode.h).
  const ColumnParallelLinear& qkv_proj() const { return qkv_; }

  // qkv (B, T, local_qkv_width()) = x_full (N, C) W_qkv^T + b; y (B, T,
  // H head_dim / P) the attention of the rank's heads; lse (B, H/P, T) kept
  // for backward.
  // `rope`: rotate q and k first (null: no rotation).
  void forward(const KernelContext& ctx, Tensor qkv, Tensor lse, Tensor y, const Tensor& x_full,
               const RotaryTables* rope = nullptr) const;
  void forward(const KernelContext& ctx, AttnActs& a, const Tensor& x_full, const RotaryTables* rope) const {
    forward(ctx, a.qkv, a.lse, a.y, x_full, rope);
  }
  // The attention core alone, y and lse from qkv (as forward leaves it,
  // rotated): what selective recomputation re-runs before backward.
  void attend(const KernelContext& ctx, const Tensor& qkv, Tensor lse, Tensor y) const;
  // From dy (B, T, H head_dim / P): dqkv (qkv's shape), then this rank's partial input gradient in
  // tp.partial() (ColumnParallelLinear::input_grad reduces it).
  void backward(const KernelContext& ctx, TpComm& tp, Tensor dqkv, const Tensor& dy, const Tensor& qkv,
                const Tensor& y, const Tensor& lse, const Tensor& x_full, const RotaryTables* rope = nullptr) const;
  void backward(const KernelContext& ctx, TpComm& tp, Tensor dqkv, const Tensor& dy, const AttnActs& a,
                const Tensor& x_full, const RotaryTables* rope) const {
    backward(ctx, tp, dqkv, dy, a.qkv, a.y, a.lse, x_full, rope);
  }

 private:
  int n_head_, n_kv_head_, head_dim_, tp_, local_heads_, local_kv_heads_;
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
};

}  // namespace xirang
