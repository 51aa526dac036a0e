// models/layers/norm.h: normalisation over the model dimension, with its
// weight (and LayerNorm's bias) replicated over the tensor-parallel group.
//
// LayerNorm (GPT-2): weight and bias, mean and rstd kept for backward.
// RMSNorm (LLaMA): weight only, y = x rstd w with rstd = 1/sqrt(mean(x^2) +
// eps); only rstd is kept (the `mean` arguments are unused: pass Tensor()).
//
// Under sequence parallelism each rank normalises only its R local rows, so
// its weight and bias gradients are partial sums: reduce_grads() all-reduces
// them over the group once per step (on the final backward).
//
//   Norm ln1(NormKind::LayerNorm);
//   ln1.declare(list, "h.0.ln_1", C, /*layer=*/0);   // h.0.ln_1.weight (ones), h.0.ln_1.bias (zeros)
//   ln1.bind(params);
//   ln1.forward(ctx, out, mean, rstd, x);            // (R, C) rows
//   ln1.backward(ctx, dx, dy, x, mean, rstd);        // dx accumulates
//   ln1.activations(list, acts, R, C, "ln_1");      // what the chunk lays out for it (activation.h)
//   Norm rms(NormKind::RMSNorm, /*eps=*/1e-5);       // layers.0.input_layernorm.weight (ones)
#pragma once

#include <string>
#include <vector>

#include "kernels/context.h"
#include "models/layers/activation.h"
#include "models/layers/param_list.h"
#include "models/layers/tp_comm.h"

namespace xirang {

enum class NormKind { LayerNorm, RMSNorm };

// What a norm keeps for its backward.
struct NormActs {
  Tensor y;     // (R, C) normalised rows
  Tensor mean;  // (R) LayerNorm only (RMSNorm: null)
  Tensor rstd;  // (R)
};

class Norm {
 public:
  // eps: RMSNorm's (the LayerNorm kernel has its own fixed 1e-5).
  explicit Norm(NormKind kind = NormKind::LayerNorm, double eps = 1e-5) : kind_(kind), eps_(eps) {}
  void declare(ParamList& list, const std::string& prefix, int64_t width, int layer);
  void bind(std::vector<Parameter>& params);
  NormKind kind() const { return kind_; }
  // y, mean (LayerNorm) and rstd of `rows` rows, kept unless full recomputation.
  void activations(ActList& list, NormActs& a, int64_t rows, int64_t width, const std::string& what) const;

  // y (R, C) = norm(x); mean (LayerNorm only) and rstd (R) are kept for backward.
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
  double eps_;
  ParamRef w_ref_, b_ref_;
  Parameter *w_ = nullptr, *b_ = nullptr;  // (C), (C) LayerNorm only
};

}  // namespace xirang
