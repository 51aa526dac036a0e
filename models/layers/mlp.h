// models/layers/mlp.h: the transformer's MLP, split by hidden units over the
// tensor-parallel group: a column-parallel up-projection with GELU fused
// into the product, and a row-parallel down-projection into the residual
// stream.
//
//   Mlp mlp;
//   mlp.declare(list, "h.0.mlp.c_fc", "h.0.mlp.c_proj", C, 4 * C, 0, InitRule::normal(0.02),
//               InitRule::scaled_residual(0.02, L));
//   mlp.bind(params);
//   mlp.forward(ctx, tp, out, h, h_gelu, x_full, /*skip=*/x);   // out (R, C) = x + mlp(x)
//
// GatedMlp is LLaMA's SwiGLU MLP without biases: one column-parallel
// gate/up projection whose weight stacks [Wg; Wu] (2F, C) in two blocks, so
// a rank holds [Wg_r; Wu_r] and its product is the packed (N, 2F/P) [g | u]
// of kernels/swiglu.h; h = silu(g) * u; a row-parallel down projection.
//
//   GatedMlp mlp;
//   mlp.declare(list, "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj", C, F, 0, InitRule::normal(0.02),
//               InitRule::normal(0.02));
//   mlp.forward(ctx, tp, out, gu, h, x_full, /*skip=*/x);        // out (R, C) = x + down(silu(g) * u)
#pragma once

#include <string>
#include <vector>

#include "models/layers/linear.h"

namespace xirang {

class Mlp {
 public:
  void declare(ParamList& list, const std::string& up_name, const std::string& down_name, int64_t width,
               int64_t hidden, int layer, InitRule up_init, InitRule down_init);
  void bind(std::vector<Parameter>& params);

  // h (N, F/P) before and h_gelu after the GELU; out (R, C) = skip + reduce(h_gelu W_down^T) + b.
  void forward(const KernelContext& ctx, TpComm& tp, Tensor out, Tensor h, Tensor h_gelu, const Tensor& x_full,
               const Tensor& skip) const;
  // forward's first half, what backward reads (h, h_gelu): recomputation
  // stops here, without the down projection and its reduction.
  void forward_hidden(const KernelContext& ctx, Tensor h, Tensor h_gelu, const Tensor& x_full) const;
  // From the gradient of all N output rows: the hidden gradient in `dh`
  // (N, F/P, also the GELU's), then this rank's partial input gradient in
  // tp.partial() (ColumnParallelLinear::input_grad reduces it).
  void backward(const KernelContext& ctx, TpComm& tp, Tensor dh, const Tensor& dy_full, const Tensor& h,
                const Tensor& h_gelu, const Tensor& x_full) const;

 private:
  ColumnParallelLinear up_;
  RowParallelLinear down_;
};

class GatedMlp {
 public:
  // gate_up weight (2F, C) = [Wg; Wu], rows split in 2 blocks; down (C, F) split by columns.
  void declare(ParamList& list, const std::string& gate_up_name, const std::string& down_name, int64_t width,
               int64_t hidden, int layer, InitRule gate_up_init, InitRule down_init);
  void bind(std::vector<Parameter>& params);

  // gu (N, 2F/P) = [g | u] and h (N, F/P) = silu(g) * u kept for backward;
  // out (R, C) = skip + reduce(h W_down^T).
  void forward(const KernelContext& ctx, TpComm& tp, Tensor out, Tensor gu, Tensor h, const Tensor& x_full,
               const Tensor& skip) const;
  // forward's first half, what backward reads (gu, h).
  void forward_hidden(const KernelContext& ctx, Tensor gu, Tensor h, const Tensor& x_full) const;
  // From the gradient of all N output rows: dh (N, F/P) and dgu (N, 2F/P)
  // scratch, then this rank's partial input gradient in tp.partial().
  void backward(const KernelContext& ctx, TpComm& tp, Tensor dgu, Tensor dh, const Tensor& dy_full, const Tensor& gu,
                const Tensor& h, const Tensor& x_full) const;

 private:
  ColumnParallelLinear gate_up_;
  RowParallelLinear down_;
};

}  // namespace xirang
