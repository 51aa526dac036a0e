// CPU AdamW.
//
// One pass per parameter: the gradient's storage type G and the model
// copy's type C are template parameters (the dtype switch is taken once, at
// the op boundary), so the element loop has no branches and vectorizes. The
// loop runs over blocks of kBlock elements; a block's updated parameters are
// rounded into the model copy while they are still in the L1 cache. The
// arithmetic per element is the same expression, in the same order, for
// every G and C, and no element depends on another, so the result does not
// depend on the thread count.
#include "kernels/adamw.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

namespace {

constexpr int64_t kBlock = 2048;

// The gradient element i of storage type G read as T (exact: widening).
template <class T, class G>
inline T grad_value(const G* g, int64_t i) {
  if constexpr (std::is_same_v<G, bf16>) return T(bf16_to_float(g[i]));
  else if constexpr (std::is_same_v<G, f16>) return T(cpu::f16_bits_to_float(g[i].bits));
  else return T(g[i]);
}

template <class T>
struct Coefficients {
  T b1, b2, lr, eps, wd, gs, ic1, ic2;
};

// Elements [b, e) of one update. The expression is the one AdamW has always
// used here; keep its order (fp32 results are compared bitwise in
// tests/kernels/adamw_test.cc).
template <class T, class G>
inline void update_range(T* __restrict p, const G* __restrict g, T* __restrict pm, T* __restrict pv,
                         const Coefficients<T>& k, int64_t b, int64_t e) {
  const T b1 = k.b1, b2 = k.b2, lr = k.lr, eps = k.eps, wd = k.wd, gs = k.gs, ic1 = k.ic1, ic2 = k.ic2;
  for (int64_t i = b; i < e; ++i) {
    T gi = grad_value<T>(g, i) * gs;
    T mi = b1 * pm[i] + (T(1) - b1) * gi;
    T vi = b2 * pv[i] + (T(1) - b2) * gi * gi;
    pm[i] = mi;
    pv[i] = vi;
    T update = (mi * ic1) / (std::sqrt(vi * ic2) + eps) + wd * p[i];
    p[i] -= lr * update;
  }
}

// The whole update: C is void without a model copy, else the copy's storage
// type (float, bf16, f16; T is float then).
template <class T, class G, class C>
void update_all(T* p, const G* g, T* pm, T* pv, C* copy, const Coefficients<T>& k, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t b = blk * kBlock, e = std::min(n, b + kBlock);
    update_range(p, g, pm, pv, k, b, e);
    if constexpr (!std::is_void_v<C>) {
      if constexpr (std::is_same_v<C, float>) {
        if (static_cast<const void*>(copy) != static_cast<const void*>(p)) std::copy(p + b, p + e, copy + b);
      } else {
        cpu::store_row(p + b, copy + b, e - b);
      }
    }
  }
}

template <class T, class G>
void update_with_copy(T* p, const G* g, T* pm, T* pv, Tensor& model_copy, const Coefficients<T>& k, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (model_copy.defined()) {
      switch (model_copy.dtype()) {
        case DType::BF16: return update_all(p, g, pm, pv, model_copy.data<bf16>(), k, n);
        case DType::F16: return update_all(p, g, pm, pv, model_copy.data<f16>(), k, n);
        default: return update_all(p, g, pm, pv, model_copy.data<float>(), k, n);
      }
    }
  }
  update_all(p, g, pm, pv, static_cast<void*>(nullptr), k, n);
}

}  // namespace

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
    const Coefficients<T> k{T(s.beta1), T(s.beta2), T(s.lr), T(s.eps), T(s.weight_decay),
                            T(s.grad_scale), T(1.0 / c1), T(1.0 / c2)};
    T* p = param.data<T>();
    T* pm = m.data<T>();
    T* pv = v.data<T>();
    // Gradients may be stored in a 16-bit type; they are read through float.
    switch (grad.dtype()) {
      case DType::BF16: return update_with_copy(p, static_cast<const bf16*>(grad.raw()), pm, pv, model_copy, k, n);
      case DType::F16: return update_with_copy(p, static_cast<const f16*>(grad.raw()), pm, pv, model_copy, k, n);
      case DType::F64:
        if constexpr (std::is_same_v<T, double>)
          return update_with_copy(p, static_cast<const double*>(grad.raw()), pm, pv, model_copy, k, n);
        else
          return;  // refused above
      default: return update_with_copy(p, static_cast<const float*>(grad.raw()), pm, pv, model_copy, k, n);
    }
  });
}

void adamw_update_group(const KernelContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& s,
                        GroupTable& table) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Optimizer);
  XR_ON_CUDA(ctx, adamw_update_group(ctx, tensors, s, table));
  // One tensor at a time, with the step each would get on its own.
  for (const AdamWTensor& t : tensors) {
    AdamWStep ts = s;
    ts.weight_decay = t.decay ? s.weight_decay : 0.0;
    adamw_update(ctx, t.param, t.grad, t.m, t.v, ts, t.model_copy);
  }
}

}  // namespace xirang
