// models/layers/norm.h: normalisation over the model dimension, with its
// weight and bias replicated over the tensor-parallel group.
//
// Under sequence parallelism each rank normalises only its R local rows, so
// its weight and bias gradients are partial sums: reduce_grads() all-reduces
// them over the group once per step (on the final backward).
//
// NormKind::RMSNorm is declared for the LLaMA family; it has no kernel yet
// and is refused at construction until it has one.
//
//   Norm ln1(NormKind::LayerNorm);
//   ln1.declare(list, "h.0.ln_1", C, /*layer=*/0);   // h.0.ln_1.weight (ones), h.0.ln_1.bias (zeros)
//   ln1.bind(params);
//   ln1.forward(ctx, out, mean, rstd, x);            // (R, C) rows
//   ln1.backward(ctx, dx, dy, x, mean, rstd);        // dx accumulates
#pragma once

#include <string>
#include <vector>

#include "kernels/context.h"
#include "models/layers/param_list.h"
#include "models/layers/tp_comm.h"

namespace xirang {

enum class NormKind { LayerNorm, RMSNorm };

class Norm {
 public:
  explicit Norm(NormKind kind = NormKind::LayerNorm);
  void declare(ParamList& list, const std::string& prefix, int64_t width, int layer);
  void bind(std::vector<Parameter>& params);

  // y (R, C) = norm(x); mean and rstd (R) are kept for backward.
  void forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x) const;
  // res = a + b, then y = norm(res): the residual add fused into the norm.
  void residual_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor mean, Tensor rstd, const Tensor& a,
                        const Tensor& b) const;
  // dx += d norm(x) / dx applied to dy; the weight and bias gradients accumulate.
  void backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& mean,
                const Tensor& rstd) const;
  // Sums the partial weight and bias gradients of sequence-parallel ranks.
  void reduce_grads(TpComm& tp) const;

 private:
  NormKind kind_;
  ParamRef w_ref_, b_ref_;
  Parameter *w_ = nullptr, *b_ = nullptr;  // (C), (C)
};

}  // namespace xirang
