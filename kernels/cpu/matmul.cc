// CPU matrix products through CBLAS (OpenBLAS).
#include "kernels/matmul.h"

#include <cblas.h>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

namespace {

template <class T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B, int64_t ldb,
          T beta, T* C, int64_t ldc) {
  auto TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void check_2d(const char* op, const char* what, const Tensor& t) {
  if (t.rank() != 2) fail(ErrorKind::Shape, op, ": ", what, " must be 2-D, got ", t.shape().str());
}

}  // namespace

void matmul(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
            double alpha, double beta) {
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
  dispatch_float(out.dtype(), "matmul", [&](auto tag) {
    using T = decltype(tag);
    gemm<T>(trans_a, trans_b, M, N, K, T(alpha), a.data<T>(), a.size(1), b.data<T>(), b.size(1), T(beta), out.data<T>(), N);
  });
}

void linear_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w, const Tensor& bias) {
  cpu::require_cpu(ctx, "linear_forward");
  check_2d("linear_forward", "x", x);
  check_2d("linear_forward", "w", w);
  int64_t N = x.size(0), in = x.size(1), out = w.size(0);
  if (w.size(1) != in)
    fail(ErrorKind::Shape, "linear_forward: x has ", in, " features but w ", w.shape().str(), " expects ", w.size(1));
  check_shape("linear_forward", "y", y, {N, out});
  if (bias.defined()) check_shape("linear_forward", "bias", bias, {out});
  dispatch_float(y.dtype(), "linear_forward", [&](auto tag) {
    using T = decltype(tag);
    T* py = y.data<T>();
    T beta = 0;
    if (bias.defined()) {
      const T* pb = bias.data<T>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < out; ++j) py[i * out + j] = pb[j];
      beta = 1;
    }
    gemm<T>(false, true, N, out, in, T(1), x.data<T>(), in, w.data<T>(), in, beta, py, out);
  });
}

void linear_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, GradMode dx_mode) {
  cpu::require_cpu(ctx, "linear_backward");
  int64_t N = x.size(0), in = x.size(1), out = w.size(0);
  check_shape("linear_backward", "dy", dy, {N, out});
  check_shape("linear_backward", "w", w, {out, in});
  check_shape("linear_backward", "dw", dw, {out, in});
  if (dx.defined()) check_shape("linear_backward", "dx", dx, {N, in});
  if (dbias.defined()) check_shape("linear_backward", "dbias", dbias, {out});
  dispatch_float(dy.dtype(), "linear_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.data<T>();
    if (dx.defined())
      gemm<T>(false, false, N, in, out, T(1), pdy, out, w.data<T>(), in, dx_mode == GradMode::Accumulate ? T(1) : T(0),
              dx.data<T>(), in);
    gemm<T>(true, false, out, in, N, T(1), pdy, out, x.data<T>(), in, T(1), dw.data<T>(), in);
    if (dbias.defined()) {
      T* pdb = dbias.data<T>();
      // Column sums: parallel over columns, rows in order, so the result is deterministic.
#pragma omp parallel for schedule(static)
      for (int64_t j0 = 0; j0 < out; j0 += 64) {
        int64_t j1 = std::min(out, j0 + 64);
        double acc[64] = {};
        for (int64_t i = 0; i < N; ++i)
          for (int64_t j = j0; j < j1; ++j) acc[j - j0] += pdy[i * out + j];
        for (int64_t j = j0; j < j1; ++j) pdb[j] += T(acc[j - j0]);
      }
    }
  });
}

}  // namespace xirang
