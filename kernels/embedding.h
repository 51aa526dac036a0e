// kernels/embedding.h: token plus learned position embedding.
//
//   embedding_forward(ctx, out, tokens, wte, wpe);     // tokens (B, T) int32 -> out (B, T, C)
//   embedding_backward(ctx, dwte, dwpe, dout, tokens); // dwte, dwpe accumulate
#pragma once

#include "kernels/context.h"

namespace xirang {

// out[b, t] = wte[tokens[b, t]] + wpe[t]; wte (V, C), wpe (>= T, C).
void embedding_forward(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                       const Tensor& wpe);
// dwte[tokens[b, t]] += dout[b, t]; dwpe[t] += sum over b of dout[b, t].
void embedding_backward(const KernelContext& ctx, Tensor dwte, Tensor dwpe, const Tensor& dout, const Tensor& tokens);

}  // namespace xirang
