// models/layers/moe_ffn.h: the mixture-of-experts feed-forward role of a
// decoder block (FfnKind::Moe), on one rank (expert parallelism is the
// communicator's next step).
//
// A router (a C -> E linear computed in fp32 whatever the storage, F64 in
// an F64 model) scores each token row; the top-k experts by score plus a
// selection bias take it (kernels/moe.h router_forward); each expert is a
// SwiGLU MLP whose weights are stacked over experts, gate_up (E, C, 2F) =
// [Wg_e | Wu_e] and down (E, F, C), run as two grouped products over the
// rows in expert order; the outputs come back weighted by the gates, plus
// the optional shared experts (one dense GatedMlp of width shared_hidden):
//   out = (skip + shared(x)) + sum_j gate_tj expert_{e_tj}(x_t)   (fma over j in order)
// Dropless: the expert-ordered buffers hold all N k rows.
//
// Balancing. The selection bias (E, not a trained parameter) is DeepSeek-V3's
// auxiliary-loss-free balancing (sec 2.1.2): after each optimizer step
// (end_step) bias_e += gamma sign(mean load - load_e) over the step's
// training forwards; it only chooses, the gates use the raw scores.
// Optionally a balance loss (model.moe.aux_loss, kernels/moe.h
// router_aux_loss) adds its gradient to the router logits; its value is
// summed apart (take_aux_loss), never into the language-model loss.
//
// Parameter names: `up_name` and `down_name` name the stacked experts
// ("layers.0.mlp.experts.gate_up_proj"); the router and the shared experts
// sit beside the experts' folder ("layers.0.mlp.gate.weight",
// "layers.0.mlp.shared_expert.gate_up_proj.weight").
//
//   MoeFeedForward ffn(dims.moe);
//   ffn.declare(list, "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj", C, F, 0, w, r, false);
//   ffn.bind(params);  ffn.activations(list_of_acts, acts, N, 1, dtype);  ffn.layout_state(arena, N, T, dtype);
//   ffn.begin_forward(dloss);  ffn.forward(ctx, tp, out, acts, x, x);  ffn.backward(ctx, tp, scratch, dy, acts, x);
//   ffn.end_step(ctx);  // after the optimizer: the bias moves
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/layers/mlp.h"

namespace xirang {

class MoeFeedForward final : public FeedForward {
 public:
  explicit MoeFeedForward(const MoeDims& moe);

  void declare(ParamList& list, const std::string& up_name, const std::string& down_name, int64_t width,
               int64_t hidden, int layer, InitRule up_init, InitRule down_init, bool bias) override;
  void bind(std::vector<Parameter>& params) override;
  void activations(ActList& list, FfnActs& a, int64_t rows, int tp, DType dtype) const override;
  void layout_state(Arena& acts, int64_t rows, int64_t sequence_rows, DType dtype) override;
  int64_t scratch_width(int tp) const override;
  // Per token: k experts of 3 matrices, the shared experts' 3 (in units of C x hidden), the router.
  int matrices() const override { return 3 * moe_.top_k; }
  // Active matrix parameters per layer, for FLOPs per token: k experts, the shared experts and the router.
  double active_matrix_params() const;

  void begin_forward(double dloss) override;
  void forward(const KernelContext& ctx, TpComm& tp, Tensor out, FfnActs& a, const Tensor& x_full,
               const Tensor& skip) const override;
  // Routing, the permutation and both expert products (what backward reads),
  // and the shared experts' hidden activations.
  void forward_hidden(const KernelContext& ctx, FfnActs& a, const Tensor& x_full) const override;
  void recompute(const KernelContext& ctx, FfnActs& a) const override;
  // No split backward yet (`later` must be null): the grouped products have no queue form.
  void backward(const KernelContext& ctx, TpComm& tp, Tensor scratch, const Tensor& dy_full, const FfnActs& a,
                const Tensor& x_full, WeightGradQueue* later) const override;

  double take_aux_loss() override;
  void end_step(const KernelContext& ctx) override;

  // Tokens per expert (E) summed over the training forwards since the last
  // end_step(), and the last step's (what the bias moved from).
  const std::vector<int64_t>& step_loads() const { return loads_; }
  const std::vector<int64_t>& last_loads() const { return last_loads_; }
  // max / mean of last_loads() (1: perfectly balanced; 0 before any step).
  double last_imbalance() const;
  // The selection bias (E), as the host keeps it.
  const std::vector<double>& bias() const { return bias_host_; }
  // Sets the bias (tests; a checkpoint's); the next forward copies it to the device's.
  void set_bias(const std::vector<double>& bias);
  const MoeDims& options() const { return moe_; }

 private:
  RouterOptions router_options() const;
  DType route_dtype() const { return dtype_ == DType::F64 ? DType::F64 : DType::F32; }
  bool sixteen() const { return dtype_ == DType::BF16 || dtype_ == DType::F16; }
  // The offsets as the grouped products want them: in host memory.
  void upload_bias(const KernelContext& ctx) const;
  Tensor host_offsets(const KernelContext& ctx, const Tensor& offsets) const;
  // logits (N, E) = x W_r^T in the routing dtype.
  void router_logits(const KernelContext& ctx, const MoeActs& m, const Tensor& x_full) const;
  void router_backward_into(const KernelContext& ctx, Tensor dx, const MoeActs& m, const Tensor& x_full) const;

  MoeDims moe_;
  int64_t C_ = 0, rows_ = 0, sequence_rows_ = 0;
  DType dtype_ = DType::F32;
  ParamRef router_ref_, gate_up_ref_, down_ref_;
  Parameter *router_ = nullptr, *gate_up_ = nullptr, *expert_down_ = nullptr;  // (E, C), (E, C, 2F), (E, F, C)
  std::unique_ptr<GatedMlp> shared_;  // width shared_hidden, or none

  // Layer state (layout_state), in the routing dtype rdt unless noted.
  Tensor bias_;     // (E) the selection bias on the device
  Tensor logits_;   // (N, E) work
  Tensor dlogits_;  // (N, E) work
  Tensor dgates_;   // (N, k) work
  Tensor routed_;   // (N, C) model dtype: the gate-weighted sum of the experts
  Tensor w32_;      // (E, C) F32 the router weight, with 16-bit storage
  Tensor dx32_;     // (N, C) F32 the router's input gradient, with 16-bit storage
  std::vector<double> bias_host_;
  mutable bool bias_ready_ = false;  // bias_ holds bias_host_
  mutable std::vector<int32_t> offsets_host_;  // (E + 1) staging for a device's offsets
  // Per step (mutable: forward is const for the chunk, these are its statistics).
  double dloss_ = 0;
  mutable std::vector<int64_t> loads_;
  std::vector<int64_t> last_loads_;
  mutable double aux_sum_ = 0;
};

}  // namespace xirang
