// CPU grouped product over experts (kernels/moe.h): one call, a loop over
// the experts' row ranges, each product on the CPU's GEMM path (the same
// one kernels/matmul.h takes: cpu::sgemm for F32, OpenBLAS dgemm for F64,
// the 16-bit tiles or oneDNN bf16 for BF16/F16). Each product is already
// multithreaded by the BLAS, so experts run one after another; the call
// saves the per-op set-up (checks, dispatch, timeline scope) E times over.
#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_16bit.h"
#include "kernels/moe.h"
#include "kernels/moe_checks.h"

namespace xirang {

using cpu::dispatch_storage;
using cpu::is_16bit_v;

namespace {

// C (M, N) = op(A) op(B) + beta C, row-major, for storage S and output O.
template <class S, class O>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const S* A, int64_t lda, const S* B, int64_t ldb, float beta,
          O* C, int64_t ldc) {
  if constexpr (is_16bit_v<S>)
    cpu::gemm_16bit_best<S, O>(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc, nullptr);
  else
    cpu::gemm(ta, tb, M, N, K, S(1), A, lda, B, ldb, S(beta), C, ldc);
}

}  // namespace

void grouped_matmul_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w,
                            const Tensor& offsets) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Matmul);
  XR_ON_CUDA(ctx, grouped_matmul_forward(ctx, y, x, w, offsets));
  const char* op = "grouped_matmul_forward";
  cpu::require_cpu(ctx, op);
  const moe_checks::GroupedDims d = moe_checks::check_grouped(op, x, w, "y", y, offsets);
  const int32_t* off = offsets.data<int32_t>();
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t M = off[e + 1] - off[e];
      if (M == 0) continue;
      gemm<S, S>(false, false, M, d.out, d.in, x.data<S>() + off[e] * d.in, d.in, w.data<S>() + e * d.in * d.out, d.out,
                 0.0f, y.data<S>() + off[e] * d.out, d.out);
    }
  });
}

void grouped_matmul_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                             const Tensor& w, const Tensor& offsets, GradMode dx_mode) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Matmul);
  XR_ON_CUDA(ctx, grouped_matmul_backward(ctx, dx, dw, dy, x, w, offsets, dx_mode));
  const char* op = "grouped_matmul_backward";
  cpu::require_cpu(ctx, op);
  const moe_checks::GroupedDims d = moe_checks::check_grouped(op, x, w, "dy", dy, offsets);
  if (dx.defined()) {
    check_same_shape(op, dx, x);
    check_dtype(op, "dx", dx, x.dtype());
  }
  if (dw.defined()) {
    check_same_shape(op, dw, w);
    moe_checks::check_weight_grad(op, dw, x.dtype());
  }
  const int32_t* off = offsets.data<int32_t>();
  const float dx_beta = dx_mode == GradMode::Accumulate ? 1.0f : 0.0f;
  dispatch_storage(x.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t M = off[e + 1] - off[e];
      if (M == 0) continue;
      const S* pdy = dy.data<S>() + off[e] * d.out;
      if (dx.defined())  // dX_e (M, in) = dY_e (M, out) W_e^T
        gemm<S, S>(false, true, M, d.in, d.out, pdy, d.out, w.data<S>() + e * d.in * d.out, d.out, dx_beta,
                   dx.data<S>() + off[e] * d.in, d.in);
      if (dw.defined())  // dW_e (in, out) += X_e^T (in, M) dY_e (M, out)
        cpu::dispatch_grad<S>(dw.dtype(), [&](auto gtag) {
          using G = decltype(gtag);
          gemm<S, G>(true, false, d.in, d.out, M, x.data<S>() + off[e] * d.in, d.in, pdy, d.out, 1.0f,
                     dw.data<G>() + e * d.in * d.out, d.out);
        });
    }
  });
}

}  // namespace xirang
