// kernels/adamw.h: the AdamW update (decoupled weight decay, bias-corrected).
//
//   AdamWStep s{.lr = lr, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
//               .weight_decay = 0.1, .step = t, .grad_scale = clip};
//   adamw_update(ctx, param, grad, m, v, s);
//
// Many tensors at once (the optimizer's step: one launch on CUDA):
//   adamw_update_group(ctx, tensors, s, table);   // table: kernels/group_table.h
#pragma once

#include <vector>

#include "kernels/context.h"
#include "kernels/group_table.h"

namespace xirang {

struct AdamWStep {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0;  // applied as param -= lr * wd * param
  int64_t step = 1;         // 1-based, for bias correction
  double grad_scale = 1.0;  // multiplies the gradient first (clipping, loss-scale removal)
};

// param, m, v share the master dtype (F32 or F64); grad is any float dtype
// (read through float). m and v are updated in place. When model_copy is
// defined (same element count, F32/BF16/F16) it receives the updated param
// rounded to its dtype: the fp32 master weights and the 16-bit weights the
// model computes with, updated in one pass.
void adamw_update(const KernelContext& ctx, Tensor param, const Tensor& grad, Tensor m, Tensor v, const AdamWStep& s,
                  Tensor model_copy = Tensor());

// One tensor of a grouped update: adamw_update's arguments, and whether
// weight decay applies to it.
struct AdamWTensor {
  Tensor param;       // (n) the f32 master, or the (f32, f64) parameter itself
  Tensor grad;        // (n)
  Tensor m, v;        // (n) param's dtype
  Tensor model_copy;  // (n) receives param rounded to its dtype, or undefined
  bool decay = true;  // s.weight_decay applies (else 0)
};

// adamw_update on every tensor of `tensors` with step `s` (its weight_decay
// where decay is set, else 0). On the CPU that is adamw_update per tensor,
// in order. On CUDA it is one launch over chunks read from `table` (written
// when the list changes); the tensors share one gradient dtype and one
// model-copy dtype, with an f32 master, and each element gets the same
// arithmetic as adamw_update.
void adamw_update_group(const KernelContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& s,
                        GroupTable& table);

}  // namespace xirang
