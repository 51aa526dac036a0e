// CPU softmax cross entropy fused with its gradient.
#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

void cross_entropy_forward_backward(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                    const Tensor& targets, int64_t vocab_size, double dloss) {
  cpu::require_cpu(ctx, "cross_entropy");
  Tensor l2 = logits.flat2d();
  int64_t N = l2.size(0), Vp = l2.size(1);
  if (vocab_size <= 0 || vocab_size > Vp)
    fail(ErrorKind::Shape, "cross_entropy: vocab_size ", vocab_size, " outside (0, ", Vp, "]");
  check_shape("cross_entropy", "targets", targets.flat(), {N});
  check_shape("cross_entropy", "losses", losses.flat(), {N});
  check_dtype("cross_entropy", "targets", targets, DType::I32);
  if (dlogits.defined()) check_same_shape("cross_entropy", dlogits, logits);
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t i = 0; i < N; ++i)
    if (tg[i] < 0 || tg[i] >= vocab_size)
      fail(ErrorKind::Data, "cross_entropy: target ", tg[i], " at position ", i, " is outside [0, ", vocab_size, ")");
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    const T* pl = logits.data<T>();
    T* pls = losses.data<T>();
    T* pd = dlogits.defined() ? dlogits.data<T>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const T* row = pl + i * Vp;
      T mx = row[0];
      for (int64_t j = 1; j < vocab_size; ++j) mx = std::max(mx, row[j]);
      double sum = 0;
      for (int64_t j = 0; j < vocab_size; ++j) sum += std::exp(double(row[j] - mx));
      double logz = std::log(sum) + double(mx);
      T target_logit = row[tg[i]];
      pls[i] = T(logz - double(target_logit));
      if (pd) {
        T* drow = pd + i * Vp;  // may alias row: each element is read before it is written
        for (int64_t j = 0; j < vocab_size; ++j) drow[j] = T(std::exp(double(row[j]) - logz) * dloss);
        drow[tg[i]] -= T(dloss);
        std::fill(drow + vocab_size, drow + Vp, T(0));
      }
    }
  });
}

}  // namespace xirang
