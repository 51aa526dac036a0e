// kernels/moe.h: the kernels of a Mixture-of-Experts feed-forward layer:
// the router, the permutation of token rows into expert order and back, and
// the grouped matrix product over experts. The layer itself (shared experts,
// balancing, expert parallelism) is not built yet; these are its pieces.
//
//   router_forward(ctx, ids, gates, scores, counts, logits, bias, opt);       // ids, gates (T, k)
//   moe_permutation(ctx, sorted_slots, slot_rows, offsets, ids, E);           // expert order
//   moe_permute(ctx, xp, x, sorted_slots);                                    // xp (T*k, d)
//   grouped_matmul_forward(ctx, h, xp, w1, offsets);                          // per expert: h_e = xp_e W1_e
//   ...                                                                       // activation, W2
//   moe_unpermute_combine(ctx, y, yp, gates, slot_rows);                      // y (T, d)
//
// Assignments. Token t's j-th choice is the slot s = t*k + j. The
// permutation sorts slots by expert, stably (equal experts keep slot
// order), so row r of the expert-ordered buffers holds slot sorted_slots[r]
// and expert e owns rows [offsets[e], offsets[e+1]). Index tensors are I32
// in host memory on the CPU (device memory on CUDA, except the offsets of
// the grouped product: see there).
//
// Routing is fp32 whatever the model's precision (logits F32, or F64 for
// gradient checks); the token rows and weights take F32, F64, BF16, F16.
#pragma once

#include <cstdint>

#include "kernels/context.h"

namespace xirang {

enum class RouterScore { Softmax, Sigmoid };

struct RouterOptions {
  RouterScore score = RouterScore::Softmax;
  int64_t top_k = 2;
  // Gates divided by the sum of the selected scores (DeepSeek-V3 with
  // sigmoid, Qwen3-MoE and Mixtral with softmax); otherwise the raw scores.
  bool normalize = true;
  // Token t's j-th choice is expert (t k + j) mod E whatever the scores
  // (the gates still use the raw scores): exactly equal loads, for tests.
  bool force_balance = false;
};

// logits (T, E) F32 or F64. bias (E), same dtype, or undefined: added to the
// scores only to choose the top-k (DeepSeek-V3's auxiliary-loss-free
// balancing); the gates use the raw scores. Top-k by biased score, ties to
// the lower expert index, each token's choices in descending order.
// Outputs: ids (T, k) I32; gates (T, k) logits dtype; scores (T, E) logits
// dtype, saved for backward; counts (E) I32, tokens per expert.
void router_forward(const KernelContext& ctx, Tensor ids, Tensor gates, Tensor scores, Tensor counts,
                    const Tensor& logits, const Tensor& bias, const RouterOptions& opt);
// dlogits (T, E) (overwritten) from dgates (T, k) through the normalisation
// and the score function; the selection has no gradient.
void router_backward(const KernelContext& ctx, Tensor dlogits, const Tensor& dgates, const Tensor& ids,
                     const Tensor& scores, const RouterOptions& opt);

// The balance loss of Switch Transformer and DeepSeek-V3 over `groups`
// equal groups of consecutive token rows (1: the whole batch, "global"; B:
// each sequence, "sequence-wise"):
//   loss = coeff * E / G * sum_g sum_e f_ge P_ge,
//   f_ge = (choices of expert e in group g) / (rows of g * k),
//   P_ge = mean over the rows of g of p_te, p = the softmax scores, or the
//          sigmoid scores divided by their sum over the E experts.
// f counts selections and has no gradient. Returns the loss (host value);
// with dlogits (T, E) defined, adds dloss_scale * d loss / d logits to it.
// The dtype of scores and dlogits: F32, or F64 for checks. CPU only so
// far (a CUDA call fails with a clear error).
double router_aux_loss(const KernelContext& ctx, Tensor dlogits, const Tensor& ids, const Tensor& scores,
                       int64_t groups, double coeff, double dloss_scale, const RouterOptions& opt);

// From ids (T, k) with values in [0, E): sorted_slots (T*k) I32, the slot of
// each expert-ordered row; slot_rows (T*k) I32, its inverse (the row of each
// slot); offsets (E+1) I32, offsets[0] = 0, offsets[E] = T*k. Stable.
void moe_permutation(const KernelContext& ctx, Tensor sorted_slots, Tensor slot_rows, Tensor offsets, const Tensor& ids,
                     int64_t num_experts);

// xp (T*k, d): row r = x (T, d) row sorted_slots[r] / k (a copy: bitwise).
void moe_permute(const KernelContext& ctx, Tensor xp, const Tensor& x, const Tensor& sorted_slots);
// dx (T, d) (overwritten) = for each token, the sum over j = 0..k-1 of dxp
// row slot_rows[t*k + j], added in that order.
void moe_permute_backward(const KernelContext& ctx, Tensor dx, const Tensor& dxp, const Tensor& slot_rows);

// y (T, d) = for each token t, sum over j = 0..k-1, in that order, of
// gates[t, j] * yp row slot_rows[t*k + j], accumulated in the compute type
// from zero as acc = fma(gate, value, acc) and stored once. A dense
// per-token loop over a token's choices in that order and form agrees with
// dispatch + combine bit for bit (an explicit fma: no compiler flag can
// change the rounding). gates (T, k) are F32 beside F32,
// BF16 and F16 rows and F64 beside F64 (the router's output, never rounded).
void moe_unpermute_combine(const KernelContext& ctx, Tensor y, const Tensor& yp, const Tensor& gates,
                           const Tensor& slot_rows);
// dyp (T*k, d) = gates[t, j] * dy row t at row slot_rows[t*k+j] (overwritten);
// dgates (T, k) (overwritten) = dot(yp row, dy row t), summed in double.
// dyp may not alias dy.
void moe_unpermute_combine_backward(const KernelContext& ctx, Tensor dyp, Tensor dgates, const Tensor& dy,
                                    const Tensor& yp, const Tensor& gates, const Tensor& slot_rows);

// Grouped product over experts: rows [offsets[e], offsets[e+1]) of x (R, in)
// times w[e] (E, in, out) into the same rows of y (R, out); an expert with no
// rows is skipped. offsets (E+1) I32 in host memory on every backend: the
// products' shapes are chosen on the host (the layer has the counts there
// for the all-to-all splits anyway). One call runs every expert.
void grouped_matmul_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w,
                            const Tensor& offsets);
// dx (R, in) = dy W_e^T per expert (per dx_mode; skipped when undefined);
// dw (E, in, out) += X_e^T dy_e (skipped when undefined; F32 beside 16-bit
// activations; an empty expert's dw is left as it is).
void grouped_matmul_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                             const Tensor& w, const Tensor& offsets, GradMode dx_mode);

}  // namespace xirang
