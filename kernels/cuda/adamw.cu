// CUDA AdamW: one pass reads the gradient (f32, bf16 or f16), updates the
// f32 master weights and both moments in place, and writes the rounded model
// copy when there is one. Same formula and float arithmetic as the CPU
// reference (kernels/cpu/adamw.cc with T = float); the host folds the bias
// corrections into 1 / c1 and 1 / c2 in double and rounds them once.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace xirang::cuda {

namespace {

constexpr int kThreads = 256;

struct AdamWCoeffs {
  float b1, b2, lr, eps, wd, grad_scale, inv_c1, inv_c2;
};

// C is the model copy's storage type (void when there is none).
template <class G, class C>
__global__ void adamw_kernel(float* __restrict__ p, const G* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, C* copy, int64_t n, AdamWCoeffs k) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = load(grad[i]) * k.grad_scale;
    const float mi = k.b1 * m[i] + (1.f - k.b1) * g;
    const float vi = k.b2 * v[i] + (1.f - k.b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i];
    const float update = (mi * k.inv_c1) / (sqrtf(vi * k.inv_c2) + k.eps) + k.wd * pi;
    const float next = pi - k.lr * update;
    p[i] = next;
    if constexpr (!std::is_void_v<C>) copy[i] = store<C>(next);
  }
}

}  // namespace

void adamw_update(const KernelContext& ctx, Tensor param, const Tensor& grad, Tensor m, Tensor v, const AdamWStep& s,
                  Tensor model_copy) {
  const char* op = "adamw_update";
  require_cuda(ctx, op);
  check_dtype(op, "param", param, DType::F32);  // the f32 master; f64 is a CPU reference type
  check_same_shape(op, param, grad);
  check_same_shape(op, param, m);
  check_same_shape(op, param, v);
  check_dtype(op, "m", m, DType::F32);
  check_dtype(op, "v", v, DType::F32);
  if (model_copy.defined() && model_copy.numel() != param.numel())
    fail(ErrorKind::Shape, "adamw_update: model_copy ", model_copy.str(), " does not match the parameter ",
         param.str(), " (expected the same element count in f32, bf16 or f16)");
  check_on_device(op, {{"param", &param}, {"grad", &grad}, {"m", &m}, {"v", &v}, {"model_copy", &model_copy}});
  const int64_t n = param.numel();
  if (n == 0) return;
  const double c1 = 1.0 - std::pow(s.beta1, double(s.step));
  const double c2 = 1.0 - std::pow(s.beta2, double(s.step));
  const AdamWCoeffs k{float(s.beta1),      float(s.beta2),     float(s.lr),       float(s.eps),
                      float(s.weight_decay), float(s.grad_scale), float(1.0 / c1), float(1.0 / c2)};
  const unsigned blocks = unsigned(std::min<int64_t>(4096, blocks_for(n, kThreads)));
  float* p = static_cast<float*>(param.raw());
  // A model copy that is the master itself needs no second write.
  const bool copy = model_copy.defined() && model_copy.raw() != param.raw();
  dispatch_storage(grad.dtype(), op, [&](auto gtag) {
    using G = decltype(gtag);
    auto launch = [&](auto* out) {
      using C = std::remove_pointer_t<decltype(out)>;
      adamw_kernel<G, C><<<blocks, kThreads, 0, stream(ctx)>>>(p, static_cast<const G*>(grad.raw()),
                                                              static_cast<float*>(m.raw()),
                                                              static_cast<float*>(v.raw()), out, n, k);
    };
    if (!copy) {
      launch(static_cast<void*>(nullptr));
      return;
    }
    dispatch_storage(model_copy.dtype(), op, [&](auto ctag) {
      using C = decltype(ctag);
      launch(static_cast<C*>(model_copy.raw()));
    });
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace xirang::cuda
