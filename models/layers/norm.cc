#include "models/layers/norm.h"

#include "core/error.h"
#include "kernels/layernorm.h"

namespace xirang {

Norm::Norm(NormKind kind) : kind_(kind) {
  XR_CHECK(kind == NormKind::LayerNorm, "RMSNorm has no kernel yet: only LayerNorm is available");
}

void Norm::declare(ParamList& list, const std::string& prefix, int64_t width, int layer) {
  w_ref_ = list.add(prefix + ".weight", list.whole({width}), false, layer, InitRule::ones());
  b_ref_ = list.add(prefix + ".bias", list.whole({width}), false, layer, InitRule::zeros());
}

void Norm::bind(std::vector<Parameter>& params) {
  w_ = &w_ref_.in(params);
  b_ = &b_ref_.in(params);
}

void Norm::forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x) const {
  layernorm_forward(ctx, y, mean, rstd, x, w_->value, b_->value);
}

void Norm::residual_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor mean, Tensor rstd, const Tensor& a,
                            const Tensor& b) const {
  residual_layernorm_forward(ctx, res, y, mean, rstd, a, b, w_->value, b_->value);
}

void Norm::backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& mean,
                    const Tensor& rstd) const {
  layernorm_backward(ctx, dx, w_->grad, b_->grad, dy, x, w_->value, mean, rstd, GradMode::Accumulate);
}

void Norm::reduce_grads(TpComm& tp) const {
  // Under sequence parallelism each rank normalised only its rows.
  if (!tp.sequence_parallel()) return;
  tp.all_reduce(w_->grad, ReduceOp::Sum);
  tp.all_reduce(b_->grad, ReduceOp::Sum);
}

}  // namespace xirang
