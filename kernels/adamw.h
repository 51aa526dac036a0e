// kernels/adamw.h: the AdamW update (decoupled weight decay, bias-corrected).
//
//   AdamWStep s{.lr = lr, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
//               .weight_decay = 0.1, .step = t, .grad_scale = clip};
//   adamw_update(ctx, param, grad, m, v, s);
#pragma once

#include "kernels/context.h"

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

}  // namespace xirang
