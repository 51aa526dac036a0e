// kernels/cpu/attention_blocked.h: the flash attention pair with float
// compute (F32, BF16, F16 storage) as blocks of query rows multiplied on
// AVX2/FMA register tiles (private to kernels/cpu; attention.cc calls it
// after checking the shapes).
//
//   cpu::attention_blocked::forward(d, qkv.data<S>(), out.data<S>(), lse.data<float>());
#pragma once

#include "kernels/attention_checks.h"

namespace xirang::cpu::attention_blocked {

// out and the log-sum-exp lse (B, H, T) of causal attention over qkv.
template <class S>
void forward(const attention_checks::Dims& d, const S* pqkv, S* pout, float* plse);

// dqkv from dout, qkv, out and lse; one task per (batch, key/value head).
template <class S>
void backward(const attention_checks::Dims& d, S* pd, const S* pdo, const S* pqkv, const S* pout, const float* plse);

}  // namespace xirang::cpu::attention_blocked
