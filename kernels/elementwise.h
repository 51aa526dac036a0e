// kernels/elementwise.h: GELU (tanh form), residual adds, scaling, casts,
// and reductions used by the optimizer.
//
// Every op takes F32, F64, BF16 and F16; the tensors of one call share the
// dtype (except cast). 16-bit values are computed on in float and rounded
// once when stored; scale forms its product in double.
//
//   gelu_forward(ctx, y, x);          // y, x (N, C)
//   add(ctx, res, res, attn_out);     // in place
#pragma once

#include <vector>

#include "kernels/context.h"
#include "kernels/group_table.h"

namespace xirang {

// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void gelu_forward(const KernelContext& ctx, Tensor y, const Tensor& x);
// dx = dy * gelu'(x); dx may alias dy.
void gelu_backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x);

// y (N, C) += bias (C) for every row.
void add_bias(const KernelContext& ctx, Tensor y, const Tensor& bias);
// out = a + b (out may alias a or b).
void add(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b);
// x *= s
void scale(const KernelContext& ctx, Tensor x, double s);
// x = 0
void zero(const KernelContext& ctx, Tensor x);
// out = in converted to out's dtype (f32, f64, bf16, f16 in any direction).
void cast(const KernelContext& ctx, Tensor out, const Tensor& in);
// Sum of squares of all elements, accumulated in double.
double sum_squares(const KernelContext& ctx, const Tensor& x);
// True when every element is finite.
bool all_finite(const KernelContext& ctx, const Tensor& x);

// The device-side forms of the reductions above, for statistics summed over
// many tensors and read back once per step: `acc` is one F64 element on the
// context's device, and nothing waits for the result.
// acc += sum of squares of x (the terms and their order as sum_squares).
void sum_squares_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x);
// acc += mean of x (F32 or F64), summed in double.
void mean_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x);

// out (one F64 element on the context's device) = the sum of squares of all
// of `xs` (one storage dtype), not waited for. On the CPU: 0, plus
// sum_squares of each tensor in order. On CUDA: one pass over chunks read
// from `table` (kernels/group_table.h), one double partial per chunk, then
// one block adds the partials in a fixed order: no atomics, so the result
// repeats bit for bit for the same list.
void sum_squares_group(const KernelContext& ctx, Tensor out, const std::vector<Tensor>& xs, GroupTable& table);

}  // namespace xirang
