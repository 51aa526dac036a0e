// CPU matrix products. F32 calls cpu::sgemm (OpenBLAS or oneDNN, chosen at
// run time: kernels/cpu/gemm.h) and F64 OpenBLAS's dgemm on the tensors.
// BF16 runs on oneDNN's bf16 matmul where the CPU has BF16 dot products;
// otherwise BF16 and F16 convert tiles of the operands to float scratch,
// call sgemm and round each result once when storing it.
#include "kernels/matmul.h"


#include <algorithm>

#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_16bit.h"
#include "kernels/elementwise.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::is_16bit_v;

namespace {

void check_2d(const char* op, const char* what, const Tensor& t) {
  if (t.rank() != 2) fail(ErrorKind::Shape, op, ": ", what, " must be 2-D, got ", t.shape().str());
}

}  // namespace

std::string cpu_gemm_path() { return std::string(cpu::gemm_path().name) + " (" + cpu::gemm_path().why + ")"; }
void set_cpu_gemm_path(const std::string& setting) { cpu::set_gemm_path(setting); }

void matmul(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
            double alpha, double beta) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Matmul);
  XR_ON_CUDA(ctx, matmul(ctx, out, a, b, trans_a, trans_b, alpha, beta));
  cpu::require_cpu(ctx, "matmul");
  check_2d("matmul", "a", a);
  check_2d("matmul", "b", b);
  check_2d("matmul", "out", out);
  int64_t M = trans_a ? a.size(1) : a.size(0), K = trans_a ? a.size(0) : a.size(1);
  int64_t Kb = trans_b ? b.size(1) : b.size(0), N = trans_b ? b.size(0) : b.size(1);
  if (K != Kb) fail(ErrorKind::Shape, "matmul: inner dimensions differ: op(a) is (", M, ", ", K, "), op(b) is (", Kb, ", ", N, ")");
  check_shape("matmul", "out", out, {M, N});
  check_dtype("matmul", "a", a, out.dtype());
  check_dtype("matmul", "b", b, out.dtype());
  if (M == 0 || N == 0) return;
  dispatch_storage(out.dtype(), "matmul", [&](auto tag) {
    using S = decltype(tag);
    if constexpr (is_16bit_v<S>)
      cpu::gemm_16bit_best<S, S>(trans_a, trans_b, M, N, K, float(alpha), a.data<S>(), a.size(1), b.data<S>(),
                                 b.size(1), float(beta), out.data<S>(), N, nullptr);
    else
      cpu::gemm(trans_a, trans_b, M, N, K, S(alpha), a.data<S>(), a.size(1), b.data<S>(), b.size(1), S(beta),
              out.data<S>(), N);
  });
}

void linear_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w, const Tensor& bias) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Matmul);
  XR_ON_CUDA(ctx, linear_forward(ctx, y, x, w, bias));
  cpu::require_cpu(ctx, "linear_forward");
  check_2d("linear_forward", "x", x);
  check_2d("linear_forward", "w", w);
  int64_t N = x.size(0), in = x.size(1), out = w.size(0);
  if (w.size(1) != in)
    fail(ErrorKind::Shape, "linear_forward: x has ", in, " features but w ", w.shape().str(), " expects ", w.size(1));
  check_shape("linear_forward", "y", y, {N, out});
  check_dtype("linear_forward", "x", x, y.dtype());
  check_dtype("linear_forward", "w", w, y.dtype());
  if (bias.defined()) {
    check_shape("linear_forward", "bias", bias, {out});
    check_dtype("linear_forward", "bias", bias, y.dtype());
  }
  dispatch_storage(y.dtype(), "linear_forward", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_16bit_v<T>) {
      cpu::gemm_16bit_best<T, T>(false, true, N, out, in, 1.0f, x.data<T>(), in, w.data<T>(), in, 0.0f, y.data<T>(),
                                 out, bias.defined() ? bias.data<T>() : nullptr);
    } else {
      T* py = y.data<T>();
      T beta = 0;
      if (bias.defined()) {
        const T* pb = bias.data<T>();
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < N; ++i)
          for (int64_t j = 0; j < out; ++j) py[i * out + j] = pb[j];
        beta = 1;
      }
      cpu::gemm(false, true, N, out, in, T(1), x.data<T>(), in, w.data<T>(), in, beta, py, out);
    }
  });
}

namespace {

// dbias (out) += column sums of dy (N, out). Parallel over columns, rows in
// order, sums in double, so the result is deterministic. F32 and F64 add the
// sum rounded to their type (as they always have); the 16-bit paths add in
// double and round once.
template <class S, class G>
void add_column_sums(const S* pdy, int64_t N, int64_t out, G* pdb) {
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < out; j0 += 64) {
    int64_t j1 = std::min(out, j0 + 64);
    double acc[64] = {};
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += cpu::load(pdy[i * out + j]);
    for (int64_t j = j0; j < j1; ++j) {
      if constexpr (is_16bit_v<S>) pdb[j] = cpu::store<G>(double(cpu::load(pdb[j])) + acc[j - j0]);
      else pdb[j] += G(acc[j - j0]);
    }
  }
}

}  // namespace

void linear_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, GradMode dx_mode) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Matmul);
  XR_ON_CUDA(ctx, linear_backward(ctx, dx, dw, dbias, dy, x, w, dx_mode));
  const char* op = "linear_backward";
  cpu::require_cpu(ctx, op);
  int64_t N = x.size(0), in = x.size(1), out = w.size(0);
  check_shape(op, "dy", dy, {N, out});
  check_shape(op, "w", w, {out, in});
  if (dw.defined()) check_shape(op, "dw", dw, {out, in});
  if (dx.defined()) check_shape(op, "dx", dx, {N, in});
  if (dbias.defined()) check_shape(op, "dbias", dbias, {out});
  const DType s = dy.dtype();
  check_dtype(op, "x", x, s);
  check_dtype(op, "w", w, s);
  if (dx.defined()) check_dtype(op, "dx", dx, s);
  if (dw.defined()) cpu::check_grad_dtype(op, "dw", dw, s);
  if (dbias.defined()) cpu::check_grad_dtype(op, "dbias", dbias, s);
  dispatch_storage(s, op, [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.data<T>();
    if constexpr (is_16bit_v<T>) {
      if (dx.defined())
        cpu::gemm_16bit_best<T, T>(false, false, N, in, out, 1.0f, pdy, out, w.data<T>(), in,
                                   dx_mode == GradMode::Accumulate ? 1.0f : 0.0f, dx.data<T>(), in, nullptr);
      // An F32 dw is summed into in place (beta 1): no 16-bit rounding at all.
      if (dw.defined())
        cpu::dispatch_grad<T>(dw.dtype(), [&](auto gtag) {
          using G = decltype(gtag);
          cpu::gemm_16bit_best<T, G>(true, false, out, in, N, 1.0f, pdy, out, x.data<T>(), in, 1.0f, dw.data<G>(),
                                     in, nullptr);
        });
    } else {
      if (dx.defined())
        cpu::gemm(false, false, N, in, out, T(1), pdy, out, w.data<T>(), in, dx_mode == GradMode::Accumulate ? T(1) : T(0),
                dx.data<T>(), in);
      if (dw.defined()) cpu::gemm(true, false, out, in, N, T(1), pdy, out, x.data<T>(), in, T(1), dw.data<T>(), in);
    }
    if (dbias.defined())
      cpu::dispatch_grad<T>(dbias.dtype(), [&](auto gtag) {
        using G = decltype(gtag);
        add_column_sums(pdy, N, out, dbias.data<G>());
      });
  });
}

// On the CPU the fused pairs run their two halves back to back: the GEMM
// dominates, and the results equal the unfused composition bit for bit.
void linear_gelu_forward(const KernelContext& ctx, Tensor y, Tensor pre, const Tensor& x, const Tensor& w,
                         const Tensor& bias) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Matmul);
  XR_ON_CUDA(ctx, linear_gelu_forward(ctx, y, pre, x, w, bias));
  cpu::require_cpu(ctx, "linear_gelu_forward");
  check_same_shape("linear_gelu_forward", y, pre);
  check_dtype("linear_gelu_forward", "y", y, pre.dtype());
  linear_forward(ctx, pre, x, w, bias);
  gelu_forward(ctx, y, pre);
}

void linear_gelu_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor dbias, Tensor dpre, const Tensor& dy,
                          const Tensor& pre, const Tensor& x, const Tensor& w, GradMode dx_mode) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Matmul);
  XR_ON_CUDA(ctx, linear_gelu_backward(ctx, dx, dw, dbias, dpre, dy, pre, x, w, dx_mode));
  cpu::require_cpu(ctx, "linear_gelu_backward");
  check_same_shape("linear_gelu_backward", dpre, pre);
  check_same_shape("linear_gelu_backward", dy, pre);
  check_dtype("linear_gelu_backward", "dpre", dpre, pre.dtype());
  check_dtype("linear_gelu_backward", "dy", dy, pre.dtype());
  gelu_backward(ctx, dpre, dy, pre);
  linear_backward(ctx, dx, dw, dbias, dpre, x, w, dx_mode);
}

}  // namespace xirang
