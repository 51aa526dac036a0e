// CPU AdamW.
#include "kernels/adamw.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

void adamw_update(const KernelContext& ctx, Tensor param, const Tensor& grad, Tensor m, Tensor v, const AdamWStep& s,
                  Tensor model_copy) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Optimizer);
  XR_ON_CUDA(ctx, adamw_update(ctx, param, grad, m, v, s, model_copy));
  cpu::require_cpu(ctx, "adamw_update");
  if (model_copy.defined()) {
    if (model_copy.numel() != param.numel() || model_copy.dtype() == DType::F64 || !is_float(model_copy.dtype()))
      fail(ErrorKind::Shape, "adamw_update: model_copy ", model_copy.str(), " does not match the parameter ",
           param.str(), " (expected the same element count in f32, bf16 or f16)");
    if (param.dtype() != DType::F32) fail(ErrorKind::Shape, "adamw_update: a model copy needs an f32 master, got ", param.str());
  }
  check_same_shape("adamw_update", param, grad);
  check_same_shape("adamw_update", param, m);
  check_same_shape("adamw_update", param, v);
  check_dtype("adamw_update", "m", m, param.dtype());
  check_dtype("adamw_update", "v", v, param.dtype());
  if (!is_float(grad.dtype()) || (grad.dtype() == DType::F64 && param.dtype() != DType::F64))
    fail(ErrorKind::Shape, "adamw_update: grad has dtype ", dtype_name(grad.dtype()), " for a ",
         dtype_name(param.dtype()), " parameter (expected f32, bf16 or f16, or f64 with an f64 parameter)");
  int64_t n = param.numel();
  const double c1 = 1.0 - std::pow(s.beta1, double(s.step));
  const double c2 = 1.0 - std::pow(s.beta2, double(s.step));
  dispatch_float(param.dtype(), "adamw_update", [&](auto tag) {
    using T = decltype(tag);
    T* p = param.data<T>();
    // Gradients may be stored in a 16-bit type; they are read through float.
    auto grad_at = [&](int64_t i) -> T {
      switch (grad.dtype()) {
        case DType::BF16: return T(bf16_to_float(static_cast<const bf16*>(grad.raw())[i]));
        case DType::F16: return T(f16_to_float(static_cast<const f16*>(grad.raw())[i]));
        case DType::F64: return T(static_cast<const double*>(grad.raw())[i]);
        default: return T(static_cast<const float*>(grad.raw())[i]);
      }
    };
    T* pm = m.data<T>();
    T* pv = v.data<T>();
    const T b1 = T(s.beta1), b2 = T(s.beta2), lr = T(s.lr), eps = T(s.eps), wd = T(s.weight_decay);
    const T gs = T(s.grad_scale), ic1 = T(1.0 / c1), ic2 = T(1.0 / c2);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      T gi = grad_at(i) * gs;
      T mi = b1 * pm[i] + (T(1) - b1) * gi;
      T vi = b2 * pv[i] + (T(1) - b2) * gi * gi;
      pm[i] = mi;
      pv[i] = vi;
      T update = (mi * ic1) / (std::sqrt(vi * ic2) + eps) + wd * p[i];
      p[i] -= lr * update;
    }
    if constexpr (std::is_same_v<T, float>)
      if (model_copy.defined()) {
        const float* src = p;
        switch (model_copy.dtype()) {
          case DType::BF16: {
            bf16* d = model_copy.data<bf16>();
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
            break;
          }
          case DType::F16: {
            f16* d = model_copy.data<f16>();
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(src[i]);
            break;
          }
          default: {
            float* d = model_copy.data<float>();
            if (d != src) std::copy(src, src + n, d);
          }
        }
      }
  });
}

}  // namespace xirang
