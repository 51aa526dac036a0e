// kernels/swiglu.h: the SwiGLU activation of LLaMA's MLP,
// down(silu(x Wg^T) * (x Wu^T)), between its matmuls.
//
//   linear_forward(ctx, gu, x, w_gate_up, {});   // gu (N, 2F) = [g | u]: one matmul with [Wg; Wu] (2F, C)
//   swiglu_packed_forward(ctx, h, gu);           // h (N, F) = silu(g) * u
//   linear_forward(ctx, y, h, w_down, {});
//   ...
//   swiglu_packed_backward(ctx, dgu, dh, gu);    // dgu (N, 2F), may be gu itself
//
// Packed form. The gate and up projections read the same x, so the model
// keeps one (2F, C) weight [Wg; Wu] and runs one matmul into an (N, 2F)
// buffer whose rows are [g | u]: one GEMM of twice the width instead of two
// (better occupancy, x read once), one activation buffer, one backward
// matmul pair. The activation reads g and u from that buffer, so the buffer
// is never split or copied. Under tensor parallelism a rank holds rows
// [r F/tp, (r+1) F/tp) of both Wg and Wu stacked as [Wg_r; Wu_r], so its
// buffer is (N, 2 F/tp) = [g_local | u_local] and the same op applies.
// The fused form stops at the buffer: silu * u is not fused into the
// cuBLASLt epilogue (it has no gated epilogue), and the down projection is a
// plain linear.
//
// silu(g) = g sigmoid(g). Backward, with s = sigmoid(g):
//   du = dh silu(g),   dg = dh u s (1 + g (1 - s)).
// The gradients are written (Overwrite): they feed the gate/up matmul's
// backward and nothing else adds to them.
//
// Every tensor of a call shares one of F32, F64, BF16, F16; 16-bit values
// are computed on in float and each output rounded once (kernels/context.h).
#pragma once

#include "kernels/context.h"

namespace xirang {

// g, u, h (N, F) (or any shape, all the same): h = silu(g) * u.
void swiglu_forward(const KernelContext& ctx, Tensor h, const Tensor& g, const Tensor& u);
// dg, du from dh; dg may alias g and du may alias u (each element is read
// before it is written).
void swiglu_backward(const KernelContext& ctx, Tensor dg, Tensor du, const Tensor& dh, const Tensor& g,
                     const Tensor& u);

// gu (.., 2F) with rows [g | u]; h (.., F).
void swiglu_packed_forward(const KernelContext& ctx, Tensor h, const Tensor& gu);
// dgu (.., 2F) = [dg | du]; dgu may alias gu (the buffer reused in place).
void swiglu_packed_backward(const KernelContext& ctx, Tensor dgu, const Tensor& dh, const Tensor& gu);

}  // namespace xirang
