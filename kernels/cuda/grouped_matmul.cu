// CUDA grouped product over experts (kernels/moe.h): a loop of cuBLASLt
// products on the context's stream, one per non-empty expert, through the
// same Gemm set-up as kernels/matmul.h (cuda::matmul, cuda::linear_backward).
//
// Why a loop: CUDA 13.0's cuBLASLt has no grouped GEMM (cublasLt.h declares
// no grouped layout); cuBLAS's cublasGemmGroupedBatchedEx needs a cublas
// handle the context does not carry and device arrays of per-group pointers
// and sizes. The offsets are on the host, so the loop costs E launches and
// no synchronization; a single grouped launch is the next step once it is
// measured on a GPU (bench/moe_grouped_bench.cc).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/moe.h"
#include "kernels/moe_checks.h"

namespace xirang::cuda {
namespace {

// Expert e's weights (in, out) of w (experts, in, out).
Tensor expert_of(const Tensor& w, int64_t e) { return w.slice(e, e + 1).view({w.size(1), w.size(2)}); }

}  // namespace

void grouped_matmul_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w,
                            const Tensor& offsets) {
  const char* op = "grouped_matmul_forward";
  require_cuda(ctx, op);
  const moe_checks::GroupedDims d = moe_checks::check_grouped(op, x, w, "y", y, offsets);
  check_on_device(op, {{"y", &y}, {"x", &x}, {"w", &w}});
  const int32_t* off = offsets.data<int32_t>();
  for (int64_t e = 0; e < d.E; ++e)
    if (off[e + 1] > off[e])  // y_e (M, out) = x_e (M, in) W_e (in, out)
      matmul(ctx, y.slice(off[e], off[e + 1]), x.slice(off[e], off[e + 1]), expert_of(w, e), false, false, 1.0,
             0.0);
}

void grouped_matmul_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                             const Tensor& w, const Tensor& offsets, GradMode dx_mode) {
  const char* op = "grouped_matmul_backward";
  require_cuda(ctx, op);
  const moe_checks::GroupedDims d = moe_checks::check_grouped(op, x, w, "dy", dy, offsets);
  if (dx.defined()) {
    check_same_shape(op, dx, x);
    check_dtype(op, "dx", dx, x.dtype());
  }
  if (dw.defined()) {  // checked here too: with every expert empty, linear_backward never sees it
    check_same_shape(op, dw, w);
    moe_checks::check_weight_grad(op, dw, x.dtype());
  }
  check_on_device(op, {{"dx", &dx}, {"dw", &dw}, {"dy", &dy}, {"x", &x}, {"w", &w}});
  const int32_t* off = offsets.data<int32_t>();
  const double beta = dx_mode == GradMode::Accumulate ? 1.0 : 0.0;
  for (int64_t e = 0; e < d.E; ++e) {
    if (off[e + 1] == off[e]) continue;
    const Tensor xe = x.slice(off[e], off[e + 1]), dye = dy.slice(off[e], off[e + 1]);
    if (dx.defined())  // dX_e = dY_e W_e^T
      matmul(ctx, dx.slice(off[e], off[e + 1]), dye, expert_of(w, e), false, true, 1.0, beta);
    // dW_e (in, out) += X_e^T dY_e: linear_backward's dw = dy'^T x' with
    // dy' = X_e and x' = dY_e, which also takes an F32 dw beside 16-bit rows.
    if (dw.defined())
      linear_backward(ctx, Tensor(), expert_of(dw, e), Tensor(), xe, dye, expert_of(w, e), GradMode::Overwrite);
  }
}

}  // namespace xirang::cuda
