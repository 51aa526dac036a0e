// kernels/rmsnorm.h: RMSNorm over the last dimension (LLaMA's norm: no mean
// subtraction, no bias), alone or fused with the residual add before it.
//
//   rmsnorm_forward(ctx, y, rstd, x, w, eps);                     // x, y (N, C); rstd (N); w (C)
//   residual_rmsnorm_forward(ctx, res, y, rstd, res, attn_out, w, eps);  // res += attn_out; y = norm(res)
//   rmsnorm_backward(ctx, dx, dw, dy, x, w, rstd, GradMode::Accumulate);
//
// y = x * rstd * w with rstd = 1 / sqrt(mean_j(x_j^2) + eps) per row. Rows
// are independent, so a sequence-parallel rank normalizes whatever run of
// token rows it holds. x, y, w share one of F32, F64, BF16, F16 (16-bit:
// computed in float, rounded once; Hugging Face instead rounds x * rstd to
// the activation dtype before multiplying by w, a second rounding). rstd is
// saved by forward for backward: the dtype of x, or F32 when x is 16-bit
// (kernels/context.h); the sum of squares accumulates in double on the CPU
// and in float on CUDA. dw may be F32 beside 16-bit activations.
#pragma once

#include "kernels/context.h"

namespace xirang {

// eps is the model's norm_eps (1e-5 for Llama 3, 1e-6 for Llama 2).
void rmsnorm_forward(const KernelContext& ctx, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, double eps);

// The residual add fused with the RMSNorm that follows it: res = a + b,
// y = RMSNorm(res) of res as stored (so the result equals add() followed by
// rmsnorm_forward() bit for bit); res may alias a or b. Its backward is
// rmsnorm_backward with dx_mode Accumulate into the residual stream's gradient.
void residual_rmsnorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor rstd, const Tensor& a,
                              const Tensor& b, const Tensor& w, double eps);

// With xhat = x rstd and g = dy w: dx = rstd (g - xhat mean_j(g xhat)), per
// dx_mode; dw += sum over rows of dy xhat. eps is not needed: rstd holds it.
void rmsnorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                      const Tensor& w, const Tensor& rstd, GradMode dx_mode);

}  // namespace xirang
