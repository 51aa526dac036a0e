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
// d_model to n_head x head_dim and back).
//
// With a q/k norm (Qwen3: AttnOptions::qk_norm) every q and k head is
// RMS-normalized over its head_dim with its own weight (q_norm, k_norm,
// head_dim each, replicated over the group) between the projection and the
// rotation (kernels/qk_norm.h). The projection's output is then kept as it
// came (qkv_raw, for the norm's backward) beside the normalized, rotated qkv
// the attention reads; backward runs the norm's backward between the
// rotation's and the projection's. A rank's q/k norm weight gradients cover
// its own heads only: reduce_grads() sums them over the group.
//
//   CausalSelfAttention attn(n_head, n_kv_head, head_dim, tp_size);
//   attn.declare(list, {.qkv = "h.0.attn.c_attn", .proj = "h.0.attn.c_proj"}, C, 0, InitRule::normal(0.02),
//                InitRule::scaled_residual(0.02, L));
//   attn.bind(params);
//   attn.forward(ctx, acts, x_full, rope);         // acts.y (B, T, H D/P) before the output projection
//   attn.proj().forward(ctx, tp, out, acts.y.flat2d(), /*skip=*/x);
#pragma once

#include <string>
#include <vector>

#include "models/layers/activation.h"
#include "models/layers/cp_comm.h"
#include "models/layers/linear.h"

namespace xirang {

// Rotary position tables cos, sin (T, head_dim / 2) for positions 0..T-1
// (kernels/rope.h's rope_table), and the sequence length of the rows.
// Under context parallelism the rows are a cp rank's share of each
// sequence: `split` and `cp_rank` give each row's position in the table.
struct RotaryTables {
  Tensor cos, sin;
  int64_t seq_len = 0;
  ContextSplit split;
  int cp_rank = 0;
};

// What attention keeps for its backward.
struct AttnActs {
  Tensor qkv;      // (B, T, local_qkv_width()) the attention's input (q and k normalized, rotated)
  Tensor qkv_raw;  // q/k norm only: the projection's output, as it came
  Tensor qk_rstd;  // q/k norm only: (B, T, (H + KV)/P) each q and k head's rstd
  Tensor lse;      // (B, H/P, T) log-sum-exp of the flash attention
  Tensor y;        // (B, T, H head_dim / P) attention output before the output projection
};

// An attention's choices beyond its shape.
struct AttnOptions {
  bool bias = true;        // the projections have biases (GPT-2) or not (LLaMA)
  bool qk_norm = false;    // per-head RMSNorm of q and k before the rotation (Qwen3)
  double qk_eps = 1e-6;    // its epsilon (the model's norm_eps)
};

// Parameter names (prefixes: "<qkv>.weight"); q_norm and k_norm with a q/k norm only.
struct AttnNames {
  std::string qkv, proj, q_norm, k_norm;
};

class CausalSelfAttention {
 public:
  CausalSelfAttention(int n_head, int n_kv_head, int head_dim, int tp, AttnOptions options = {});
  void declare(ParamList& list, const AttnNames& names, int64_t width, int layer, InitRule qkv_init,
               InitRule proj_init);
  void bind(std::vector<Parameter>& params);
  int local_heads() const { return local_heads_; }
  int head_dim() const { return head_dim_; }
  bool qk_norm() const { return options_.qk_norm; }
  // qkv (and the q/k norm's input and rstd) kept unless full recomputation;
  // lse and y rebuilt by selective recomputation (attend()).
  void activations(ActList& list, AttnActs& a, int64_t batch, int64_t seq_len) const;
  // Columns of this rank's fused q, k, v rows: (H + 2 Hkv) head_dim / P.
  int64_t local_qkv_width() const;
  const RowParallelLinear& proj() const { return proj_; }
  // The fused q/k/v projection (generation runs it on its own rows: models/decode.h).
  const ColumnParallelLinear& qkv_proj() const { return qkv_; }

  // a.qkv (B, T, local_qkv_width()) = x_full (N, C) W_qkv^T + b (through
  // the q/k norm: a.qkv_raw, a.qk_rstd); a.y (B, T, H head_dim / P) the
  // attention of the rank's heads; a.lse (B, H/P, T) kept for backward.
  // `rope`: rotate q and k first (null: no rotation).
  void forward(const KernelContext& ctx, AttnActs& a, const Tensor& x_full, const RotaryTables* rope,
               CpComm* cp = nullptr) const;
  // The q/k norm of `raw` into `out` (B, T, qkv width; `out` may be `raw`
  // where no backward follows: generation), rstd (B, T, (H + KV)/P).
  void normalize_qk(const KernelContext& ctx, Tensor out, Tensor rstd, const Tensor& raw) const;
  // The attention core alone, y and lse from qkv (as forward leaves it,
  // rotated): what selective recomputation re-runs before backward. With a
  // context-parallel `cp` that splits the sequence, the queries of this
  // rank's rows attend to every rank's keys and values (gathered).
  void attend(const KernelContext& ctx, const Tensor& qkv, Tensor lse, Tensor y, CpComm* cp = nullptr) const;
  // From dy (B, T, H head_dim / P): dqkv (qkv's shape), then this rank's partial input gradient in
  // tp.partial() (ColumnParallelLinear::input_grad reduces it).
  // `later`: the q/k/v projection's weight product is left to it (weight_grads.h).
  // With a splitting `cp`, the keys and values are gathered again and their
  // gradients reduce-scattered back to the ranks that hold them.
  void backward(const KernelContext& ctx, TpComm& tp, Tensor dqkv, const Tensor& dy, const AttnActs& a,
                const Tensor& x_full, const RotaryTables* rope, WeightGradQueue* later = nullptr,
                CpComm* cp = nullptr) const;
  // Columns of this rank's packed k and v (kernels/cp_attention.h kv_pack): 2 Hkv head_dim / P.
  int64_t local_kv_width() const { return 2 * int64_t(local_kv_heads_) * head_dim_; }
  // Sums the q/k norm weight gradients over the group (each rank saw its own heads); a no-op without.
  void reduce_grads(TpComm& tp) const;

 private:
  int n_head_, n_kv_head_, head_dim_, tp_, local_heads_, local_kv_heads_;
  AttnOptions options_;
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
  ParamRef q_norm_ref_, k_norm_ref_;
  Parameter *q_norm_ = nullptr, *k_norm_ = nullptr;  // (head_dim) each, replicated
};

}  // namespace xirang
