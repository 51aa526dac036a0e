// models/layers/linear.h: the tensor-parallel linear layers (Megatron's split).
//
// ColumnParallelLinear: y (N, out/P) = x (N, in) W^T + b, with W's output
// rows split over the P ranks (in blocks, each split alike: the fused QKV's
// q, k and v rows, of unequal extents under grouped-query attention). Its
// input is the whole (N, in) activation (TpComm::gathered under sequence
// parallelism); backward leaves partial input gradients summed over this
// rank's rows in TpComm::partial(), which input_grad() reduces: the
// identity-forward / all-reduce-backward pair.
//
// RowParallelLinear: y (R, out) = x (N, in/P) W^T + b + skip, with W's input
// columns split; each rank's product is a partial sum that forward reduces
// into the local rows (all-reduce, or reduce-scatter under sequence
// parallelism) before the bias, added once, and the residual skip: the
// all-reduce-forward / identity-backward pair. Its backward takes the
// gradient of all N rows (TpComm::full_rows).
//
//   ColumnParallelLinear fc;  fc.declare(list, "h.0.mlp.c_fc", {4 * C}, C, 0, InitRule::normal(0.02));
//   RowParallelLinear proj;   proj.declare(list, "h.0.mlp.c_proj", C, 4 * C, 0, InitRule::scaled_residual(0.02, L));
//   fc.bind(params);  proj.bind(params);
//   fc.forward_gelu(ctx, h_gelu, h, x_full);
//   proj.forward(ctx, tp, out, h_gelu, /*skip=*/x);
#pragma once

#include <string>
#include <vector>

#include "kernels/context.h"
#include "models/layers/param_list.h"
#include "models/layers/tp_comm.h"
#include "models/layers/weight_grads.h"

namespace xirang {

class ColumnParallelLinear {
 public:
  // `out_blocks`: the global extent of each block of output rows (one block:
  // {out}); weight (sum, in) split by rows over the group, bias likewise
  // (none when `bias` is false: LLaMA).
  void declare(ParamList& list, const std::string& prefix, std::vector<int64_t> out_blocks, int64_t in, int layer,
               InitRule init, bool bias = true);
  void bind(std::vector<Parameter>& params);
  const Parameter& weight() const { return *w_; }

  // y = x W^T + b: x (N, in), y (N, out/P).
  void forward(const KernelContext& ctx, Tensor y, const Tensor& x) const;
  // y = gelu(pre), pre = x W^T + b, fused.
  void forward_gelu(const KernelContext& ctx, Tensor y, Tensor pre, const Tensor& x) const;
  // dx (N, in) = dy W (this rank's partial sum); dW, db accumulate.
  // `later`: dW's product is left to it (a split backward: weight_grads.h).
  void backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x,
                WeightGradQueue* later = nullptr) const;
  // Through the GELU too: dpre and dx from dy = d gelu(pre).
  void backward_gelu(const KernelContext& ctx, Tensor dx, Tensor dpre, const Tensor& dy, const Tensor& pre,
                     const Tensor& x, WeightGradQueue* later = nullptr) const;
  // The partial input gradient (N, in) in tp.partial() reduced to the local
  // rows: into `local` (R, in) under sequence parallelism, else in place.
  static Tensor input_grad(TpComm& tp, Tensor local);

 private:
  ParamRef w_ref_, b_ref_;
  Parameter *w_ = nullptr, *b_ = nullptr;  // (out/P, in), (out/P) or none
  Tensor bias_value() const;
  Tensor bias_grad() const;
};

class RowParallelLinear {
 public:
  // weight (out, in) split by columns; bias (out) replicated (none when `bias` is false).
  void declare(ParamList& list, const std::string& prefix, int64_t out, int64_t in, int layer, InitRule init,
               bool bias = true);
  void bind(std::vector<Parameter>& params);

  // y (R, out) = reduce(x W^T) + b + skip: x (N, in/P).
  void forward(const KernelContext& ctx, TpComm& tp, Tensor y, const Tensor& x, const Tensor& skip) const;
  // Without a split: y (N, out) = x W^T + b, the bias fused in the product
  // (the caller adds the residual, e.g. fused into the next norm).
  void forward_unsplit(const KernelContext& ctx, Tensor y, const Tensor& x) const;
  // dx (N, in/P) = dy W from the gradient of all N rows; dW, db accumulate
  // (`later`: dW's product is left to it).
  void backward(const KernelContext& ctx, Tensor dx, const Tensor& dy_full, const Tensor& x,
                WeightGradQueue* later = nullptr) const;

 private:
  ParamRef w_ref_, b_ref_;
  Parameter *w_ = nullptr, *b_ = nullptr;  // (out, in/P), (out) or none
};

}  // namespace xirang
