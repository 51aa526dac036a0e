// CPU LayerNorm: statistics and the weight/bias gradient reductions in double.
#include "kernels/layernorm.h"

#include <cmath>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

void layernorm_forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b) {
  cpu::require_cpu(ctx, "layernorm_forward");
  Tensor x2 = x.flat2d();
  int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape("layernorm_forward", y, x);
  check_shape("layernorm_forward", "w", w, {C});
  check_shape("layernorm_forward", "b", b, {C});
  check_shape("layernorm_forward", "mean", mean.flat(), {N});
  check_shape("layernorm_forward", "rstd", rstd.flat(), {N});
  dispatch_float(x.dtype(), "layernorm_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* pb = b.data<T>();
    T* py = y.data<T>();
    T* pm = mean.data<T>();
    T* pr = rstd.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const T* xi = px + i * C;
      double s = 0;
      for (int64_t j = 0; j < C; ++j) s += xi[j];
      double m = s / double(C);
      double v = 0;
      for (int64_t j = 0; j < C; ++j) v += (xi[j] - m) * (xi[j] - m);
      double r = 1.0 / std::sqrt(v / double(C) + kLayerNormEps);
      T* yi = py + i * C;
      for (int64_t j = 0; j < C; ++j) yi[j] = T((xi[j] - m) * r) * pw[j] + pb[j];
      pm[i] = T(m);
      pr[i] = T(r);
    }
  });
}

void layernorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor db, const Tensor& dy, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, GradMode dx_mode) {
  cpu::require_cpu(ctx, "layernorm_backward");
  Tensor x2 = x.flat2d();
  int64_t N = x2.size(0), C = x2.size(1);
  check_same_shape("layernorm_backward", dy, x);
  check_same_shape("layernorm_backward", dx, x);
  check_shape("layernorm_backward", "dw", dw, {C});
  check_shape("layernorm_backward", "db", db, {C});
  check_shape("layernorm_backward", "w", w, {C});
  check_shape("layernorm_backward", "mean", mean.flat(), {N});
  check_shape("layernorm_backward", "rstd", rstd.flat(), {N});
  dispatch_float(x.dtype(), "layernorm_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    const T* pw = w.data<T>();
    const T* pm = mean.data<T>();
    const T* pr = rstd.data<T>();
    T* pdx = dx.data<T>();
    const bool acc = dx_mode == GradMode::Accumulate;
    // Per-chunk partial sums of dw and db, reduced in chunk order afterwards.
    std::vector<double> part(size_t(cpu::kReduceChunks) * 2 * C, 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < cpu::kReduceChunks; ++c) {
      double* pdw = part.data() + c * 2 * C;
      double* pdb = pdw + C;
      for (int64_t i = cpu::chunk_begin(N, c); i < cpu::chunk_begin(N, c + 1); ++i) {
        const T* xi = px + i * C;
        const T* dyi = pdy + i * C;
        double m = pm[i], r = pr[i];
        double sum_g = 0, sum_gx = 0;  // mean of dxhat and of dxhat * xhat, times C
        for (int64_t j = 0; j < C; ++j) {
          double xhat = (xi[j] - m) * r;
          double g = double(dyi[j]) * pw[j];
          sum_g += g;
          sum_gx += g * xhat;
          pdw[j] += double(dyi[j]) * xhat;
          pdb[j] += dyi[j];
        }
        sum_g /= double(C);
        sum_gx /= double(C);
        T* dxi = pdx + i * C;
        for (int64_t j = 0; j < C; ++j) {
          double xhat = (xi[j] - m) * r;
          double v = r * (double(dyi[j]) * pw[j] - sum_g - xhat * sum_gx);
          dxi[j] = acc ? T(dxi[j] + v) : T(v);
        }
      }
    }
    T* out_w = dw.data<T>();
    T* out_b = db.data<T>();
    for (int64_t j = 0; j < C; ++j) {
      double sw = 0, sb = 0;
      for (int64_t c = 0; c < cpu::kReduceChunks; ++c) {
        sw += part[c * 2 * C + j];
        sb += part[c * 2 * C + C + j];
      }
      out_w[j] += T(sw);
      out_b[j] += T(sb);
    }
  });
}

}  // namespace xirang
