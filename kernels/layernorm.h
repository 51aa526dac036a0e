// kernels/layernorm.h: LayerNorm over the last dimension.
//
//   layernorm_forward(ctx, y, mean, rstd, x, w, b);   // x, y (N, C); mean, rstd (N)
//   layernorm_backward(ctx, dx, dw, db, dy, x, w, mean, rstd, GradMode::Accumulate);
//
// x, y, w, b share one of F32, F64, BF16, F16 (16-bit: computed in float,
// rounded once). mean and rstd are saved by forward for backward: the dtype
// of x, or F32 when x is 16-bit (kernels/context.h); statistics accumulate in
// double. The gradients dw and db may be F32 beside 16-bit activations.
#pragma once

#include "kernels/context.h"

namespace xirang {

constexpr double kLayerNormEps = 1e-5;

void layernorm_forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b);

// The residual add fused with the LayerNorm that follows it: res = a + b,
// y = LayerNorm(res) of res as stored (so the result equals add +
// layernorm_forward); res may alias a. Its backward is layernorm_backward
// with dx_mode Accumulate into the residual stream's gradient.
void residual_layernorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor mean, Tensor rstd,
                                const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias);

// dx per dx_mode; dw, db accumulate (+=).
void layernorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor db, const Tensor& dy, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, GradMode dx_mode);

}  // namespace xirang
