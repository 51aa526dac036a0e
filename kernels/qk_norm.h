// kernels/qk_norm.h: Qwen3's per-head RMSNorm of the queries and keys
// (q_norm, k_norm in transformers' Qwen3Attention), applied to the packed
// attention input before the rotary embedding.
//
//   // qkv, out (B, T, (H + 2 KV) D); rstd (B, T, H + KV); q_w, k_w (D)
//   qk_rmsnorm_forward(ctx, out, rstd, qkv, q_w, k_w, n_head, n_kv_head, eps);
//   rope_qkv_forward(ctx, out, cos, sin, n_head, n_kv_head, T, 0);
//   ...attention forward and backward, rope_qkv_backward(ctx, dout, ...)...
//   qk_rmsnorm_backward(ctx, dqkv, dq_w, dk_w, dout, qkv, q_w, k_w, rstd, n_head, n_kv_head,
//                       GradMode::Overwrite);
//
// Each row of qkv holds [q_0 .. q_{H-1} | k_0 .. k_{KV-1} | v_0 .. v_{KV-1}],
// each head D wide (D = q_w.size(0), which need not be d_model / H). Every
// q head is normalized with q_w and every k head with k_w:
//   y = x rstd w, rstd = 1 / sqrt(mean_j(x_j^2) + eps) over the head's D;
// the v heads are copied unchanged. The arithmetic is rmsnorm_forward's
// (kernels/rmsnorm.h) applied to each head as a row of D: the same dtypes,
// the same single rounding of 16-bit outputs (Hugging Face rounds x rstd to
// the activation dtype before the weight), the sum of squares in double on
// the CPU and in float on CUDA. On the CPU, a head's result equals
// rmsnorm_forward of that head bit for bit.
//
// Saved for backward: rstd, one per q and k head, (B, T, H + KV) with the
// q heads first ([rstd q_0 .. rstd q_{H-1} | rstd k_0 .. rstd k_{KV-1}]),
// in rmsnorm's stat dtype (the dtype of qkv, or F32 beside 16-bit; F32 on
// CUDA). It is 1/D of the q and k activations (under 1% at D = 128), and
// saving it rather than recomputing it keeps backward free of eps and lets
// the CUDA tests feed the kernel's own rstd to the CPU reference, as
// rmsnorm's do. Backward also needs qkv as it was before normalization.
//
// Tensor parallelism: a rank holds n_head / tp query and n_kv_head / tp
// key/value heads per token in the same layout and the whole replicated
// q_w, k_w; it passes its local head counts. Its dq_w, dk_w cover only its
// own heads, so the weight gradients are summed over the tp group like any
// other replicated parameter's.
#pragma once

#include "kernels/context.h"

namespace xirang {

// out may be qkv itself (normalized in place) where no backward follows
// (generation); training keeps the pre-norm qkv for backward. Any other
// overlap of out and qkv is undefined. eps is the model's rms_norm_eps
// (1e-6 for Qwen3).
void qk_rmsnorm_forward(const KernelContext& ctx, Tensor out, Tensor rstd, const Tensor& qkv, const Tensor& q_w,
                        const Tensor& k_w, int n_head, int n_kv_head, double eps);

// dout is d loss / d out; dqkv gets d loss / d qkv per dx_mode. For a q or
// k head, with xhat = x rstd and g = dout w:
//   dx = rstd (g - xhat mean_j(g xhat));
// for a v head, dx = dout. dq_w += sum over q heads and tokens of dout xhat,
// dk_w likewise over the k heads (the weight gradients always accumulate,
// as rmsnorm's dw). dqkv may be dout itself with GradMode::Overwrite (the
// gradient buffer turned around in place); dq_w and dk_w may be F32 beside
// 16-bit activations.
void qk_rmsnorm_backward(const KernelContext& ctx, Tensor dqkv, Tensor dq_w, Tensor dk_w, const Tensor& dout,
                         const Tensor& qkv, const Tensor& q_w, const Tensor& k_w, const Tensor& rstd, int n_head,
                         int n_kv_head, GradMode dx_mode);

}  // namespace xirang
