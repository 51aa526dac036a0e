// kernels/matmul.h: matrix products and the linear layer built on them.
//
// Conventions: row-major; a linear weight is (out_features, in_features) and
// y = x W^T + b. Activations are flattened to (N, features) by the caller.
//
// Dtypes (kernels/context.h): activations and weights share one of F32, F64,
// BF16, F16. 16-bit products are summed in float over the whole inner
// dimension and each output is rounded once. The parameter gradients dw and
// dbias are that dtype or, beside 16-bit activations, F32 (summed into in
// float, never rounded to 16 bits).
//
//   linear_forward(ctx, y, x, w, b);                  // y (N, out)
//   linear_backward(ctx, dx, dw, db, dy, x, w, GradMode::Overwrite);
#pragma once

#include <string>

#include "kernels/context.h"

namespace xirang {

// The CPU's GEMM path in this process and how it was chosen, one line, e.g.
// "onednn (auto: CPU: AVX-512 with BF16, kernels generated for it by oneDNN)";
// kernels/cpu/gemm.h has the paths and XIRANG_CPU_GEMM.
std::string cpu_gemm_path();
// Sets it as XIRANG_CPU_GEMM=setting would (auto, openblas, onednn); only
// while no product runs.
void set_cpu_gemm_path(const std::string& setting);

// out (M, N) = alpha * op(a) op(b) + beta * out, op = transpose when trans_*.
// All three tensors share the dtype (F32, F64, BF16 or F16).
void matmul(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
            double alpha = 1.0, double beta = 0.0);

// y (N, out) = x (N, in) w (out, in)^T + bias (out); bias may be undefined.
void linear_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w, const Tensor& bias);

// dx (N, in) = dy w (overwritten or accumulated per dx_mode; skipped when dx is undefined);
// dw (out, in) += dy^T x (skipped when undefined);  dbias (out) += sum over rows of dy (skipped when undefined);
// dw and dbias may be F32 when the activations are 16-bit. The three
// results are computed independently, so a call for dx and dbias and a
// later one for dw (a split backward pass) give bitwise those of one call.
void linear_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, GradMode dx_mode);

// The MLP up-projection with its activation: pre (N, out) = x w^T + bias,
// y (N, out) = gelu(pre). On the CPU, and on CUDA for f32, GELU is taken of
// pre as stored, so the result equals linear_forward + gelu_forward. On
// CUDA with 16-bit storage one cuBLASLt GELU epilogue computes both, taking
// GELU of the unrounded float pre: y may differ from gelu(stored pre) by one
// 16-bit rounding of pre (times |gelu'| <= 1.13).
void linear_gelu_forward(const KernelContext& ctx, Tensor y, Tensor pre, const Tensor& x, const Tensor& w,
                         const Tensor& bias);
// Backward of linear_gelu_forward given dy = dL/dy: dpre (N, out) = dy *
// gelu'(pre) (dpre may alias dy), then linear_backward from dpre.
void linear_gelu_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor dbias, Tensor dpre, const Tensor& dy,
                          const Tensor& pre, const Tensor& x, const Tensor& w, GradMode dx_mode);

}  // namespace xirang
