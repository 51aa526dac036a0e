// models/layers/mlp.h: the feed-forward role of a decoder block, split by
// hidden units over the tensor-parallel group: a column-parallel
// up-projection, an activation, and a row-parallel down-projection into the
// residual stream. Every variant has the one FeedForward signature, so a
// block swaps one for another; the mixture of experts (moe_ffn.h) is the
// third, with its own state beside the per-microbatch activations.
//
// Mlp (GPT-2): GELU (tanh form) fused into the up-projection's product.
// GatedMlp (LLaMA's SwiGLU, no biases): one gate/up projection whose weight
// stacks [Wg; Wu] (2F, C) in two blocks, so a rank holds [Wg_r; Wu_r] and
// its product is the packed (N, 2F/P) [g | u] of kernels/swiglu.h;
// h = silu(g) * u.
//
//   std::unique_ptr<FeedForward> ffn = make_feed_forward(FfnKind::Gelu);
//   ffn->declare(list, "h.0.mlp.c_fc", "h.0.mlp.c_proj", C, 4 * C, 0, InitRule::normal(0.02),
//                InitRule::scaled_residual(0.02, L), /*bias=*/true);
//   ffn->activations(list_of_acts, acts, N, tp, dtype);
//   ffn->bind(params);
//   ffn->forward(ctx, tp, out, acts, x_full, /*skip=*/x);   // out (R, C) = x + ffn(x)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "models/dims.h"
#include "models/layers/activation.h"
#include "models/layers/linear.h"

namespace xirang {

enum class FfnKind { Gelu, SwiGlu, Moe };

// What the mixture of experts (moe_ffn.h) keeps for its backward, for N
// token rows, k choices each, E experts of hidden width F; routing dtype
// (rdt): F32, or F64 with an F64 model.
struct MoeActs {
  Tensor x32;           // (N, C) F32 the router's input, with 16-bit storage only
  Tensor scores;        // (N, E) rdt
  Tensor ids;           // (N, k) I32 the chosen experts
  Tensor gates;         // (N, k) rdt
  Tensor sorted_slots;  // (N k) I32 the slot of each expert-ordered row
  Tensor slot_rows;     // (N k) I32 the expert-ordered row of each slot
  Tensor offsets;       // (E + 1) I32 expert e owns rows [offsets[e], offsets[e+1])
  Tensor xp;            // (N k, C) token rows in expert order
  Tensor gu;            // (N k, 2F) [g | u] of each expert row
  Tensor h;             // (N k, F) silu(g) * u
  Tensor yp;            // (N k, C) each expert row's output
};

// What a feed-forward keeps for its backward.
struct FfnActs {
  Tensor pre;   // (N, width) the up-projection's output (GELU: F/P; SwiGLU: [g | u], 2F/P); MoE: the shared experts'
  Tensor post;  // (N, F/P) the activation's output, the down-projection's input
  MoeActs moe;  // the routed experts' (MoE only)
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // up (rows split, in blocks for a gated variant) and down (columns split), hidden width F.
  virtual void declare(ParamList& list, const std::string& up_name, const std::string& down_name, int64_t width,
                       int64_t hidden, int layer, InitRule up_init, InitRule down_init, bool bias) = 0;
  virtual void bind(std::vector<Parameter>& params) = 0;
  // pre and post of `rows` token rows (N); dtype: the activations' storage.
  virtual void activations(ActList& list, FfnActs& a, int64_t rows, int tp, DType dtype) const = 0;
  // Columns of backward scratch per row (N): what backward() carves from `scratch`.
  virtual int64_t scratch_width(int tp) const = 0;
  // Matrices of `width` x `hidden`: training FLOPs are 6 per weight per token.
  virtual int matrices() const = 0;

  // out (R, C) = skip + reduce(down(act(up(x_full)))); a keeps pre and post.
  virtual void forward(const KernelContext& ctx, TpComm& tp, Tensor out, FfnActs& a, const Tensor& x_full,
                       const Tensor& skip) const {
    forward_hidden(ctx, a, x_full);
    down_.forward(ctx, tp, out, a.post, skip);
  }

  // Layer state and work buffers outside the activation slots, for `rows`
  // token rows (the MoE router's bias and scratch); none for dense ones.
  // `sequence_rows`: the rows of one sequence (a sequence-wise balance loss's groups).
  virtual void layout_state(Arena& /*acts*/, int64_t /*rows*/, int64_t /*sequence_rows*/, DType /*dtype*/) {}
  // Before a chunk's forward: dloss per token row (0: not training; the
  // MoE layer then neither counts loads nor adds its balance loss).
  virtual void begin_forward(double /*dloss*/) {}
  // The balance loss summed over the training forwards since the last call (0 without one).
  virtual double take_aux_loss() { return 0.0; }
  // After the optimizer step: the MoE layer moves its selection bias from the step's loads.
  virtual void end_step(const KernelContext& /*ctx*/) {}
  // forward's first half, what backward reads (pre, post): full recomputation
  // stops here, without the down projection and its reduction.
  virtual void forward_hidden(const KernelContext& ctx, FfnActs& a, const Tensor& x_full) const = 0;
  // Rebuilds post from pre (selective recomputation) when activations() let it go.
  virtual void recompute(const KernelContext& ctx, FfnActs& a) const = 0;
  // From the gradient of all N output rows, through scratch (N x
  // scratch_width), this rank's partial input gradient in tp.partial()
  // (ColumnParallelLinear::input_grad reduces it). `later`: the weight
  // products are left to it (weight_grads.h).
  virtual void backward(const KernelContext& ctx, TpComm& tp, Tensor scratch, const Tensor& dy_full,
                        const FfnActs& a, const Tensor& x_full, WeightGradQueue* later = nullptr) const = 0;
  // Single-rank path of down(): out = post W_down^T + b, then skip added by the caller.
  const RowParallelLinear& down() const { return down_; }

 protected:
  int64_t hidden_ = 0;
  RowParallelLinear down_;
};

class Mlp final : public FeedForward {
 public:
  void declare(ParamList& list, const std::string& up_name, const std::string& down_name, int64_t width,
               int64_t hidden, int layer, InitRule up_init, InitRule down_init, bool bias) override;
  void bind(std::vector<Parameter>& params) override;
  // With fp32 or fp64 storage selective recomputation rebuilds the GELU
  // output from the kept fc output; with 16-bit storage a device computes
  // GELU of the unrounded product, which the stored fc output cannot
  // reproduce, so both are kept.
  void activations(ActList& list, FfnActs& a, int64_t rows, int tp, DType dtype) const override;
  int64_t scratch_width(int tp) const override { return hidden_ / tp; }
  int matrices() const override { return 2; }
  void forward_hidden(const KernelContext& ctx, FfnActs& a, const Tensor& x_full) const override;
  void recompute(const KernelContext& ctx, FfnActs& a) const override;
  void backward(const KernelContext& ctx, TpComm& tp, Tensor scratch, const Tensor& dy_full, const FfnActs& a,
                const Tensor& x_full, WeightGradQueue* later) const override;

 private:
  ColumnParallelLinear up_;
};

class GatedMlp final : public FeedForward {
 public:
  void declare(ParamList& list, const std::string& gate_up_name, const std::string& down_name, int64_t width,
               int64_t hidden, int layer, InitRule gate_up_init, InitRule down_init, bool bias) override;
  void bind(std::vector<Parameter>& params) override;
  // silu(g) * u is rebuilt by selective recomputation.
  void activations(ActList& list, FfnActs& a, int64_t rows, int tp, DType dtype) const override;
  int64_t scratch_width(int tp) const override { return 3 * hidden_ / tp; }  // dgu (2F/P), dh (F/P)
  int matrices() const override { return 3; }
  void forward_hidden(const KernelContext& ctx, FfnActs& a, const Tensor& x_full) const override;
  void recompute(const KernelContext& ctx, FfnActs& a) const override;
  void backward(const KernelContext& ctx, TpComm& tp, Tensor scratch, const Tensor& dy_full, const FfnActs& a,
                const Tensor& x_full, WeightGradQueue* later) const override;

 private:
  ColumnParallelLinear gate_up_;
};

// `moe` configures FfnKind::Moe (models/layers/moe_ffn.h).
std::unique_ptr<FeedForward> make_feed_forward(FfnKind kind, const MoeDims& moe = {});

}  // namespace xirang
