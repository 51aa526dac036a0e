#include "models/layers/norm.h"

#include "core/error.h"
#include "kernels/layernorm.h"
#include "kernels/rmsnorm.h"

namespace xirang {

void Norm::declare(ParamList& list, const std::string& prefix, int64_t width, int layer) {
  w_ref_ = list.add(prefix + ".weight", list.whole({width}), false, layer, InitRule::ones());
  if (kind_ == NormKind::LayerNorm)
    b_ref_ = list.add(prefix + ".bias", list.whole({width}), false, layer, InitRule::zeros());
}

void Norm::activations(ActList& list, NormActs& a, int64_t rows, int64_t width, const std::string& what) const {
  list.push_back({&a.y, {rows, width}, false, what + " output", Keep::UnlessFull});
  if (kind_ == NormKind::LayerNorm) list.push_back({&a.mean, {rows}, true, what + " mean", Keep::UnlessFull});
  list.push_back({&a.rstd, {rows}, true, what + " rstd", Keep::UnlessFull});
}

void Norm::bind(std::vector<Parameter>& params) {
  w_ = &w_ref_.in(params);
  b_ = b_ref_.declared() ? &b_ref_.in(params) : nullptr;
}

void Norm::forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x) const {
  if (kind_ == NormKind::RMSNorm) return rmsnorm_forward(ctx, y, rstd, x, w_->value, eps_);
  layernorm_forward(ctx, y, mean, rstd, x, w_->value, b_->value);
}

void Norm::residual_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor mean, Tensor rstd, const Tensor& a,
                            const Tensor& b) const {
  if (kind_ == NormKind::RMSNorm) return residual_rmsnorm_forward(ctx, res, y, rstd, a, b, w_->value, eps_);
  residual_layernorm_forward(ctx, res, y, mean, rstd, a, b, w_->value, b_->value);
}

void Norm::backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& mean,
                    const Tensor& rstd) const {
  if (kind_ == NormKind::RMSNorm)
    return rmsnorm_backward(ctx, dx, w_->grad, dy, x, w_->value, rstd, GradMode::Accumulate);
  layernorm_backward(ctx, dx, w_->grad, b_->grad, dy, x, w_->value, mean, rstd, GradMode::Accumulate);
}

void Norm::reduce_grads(TpComm& tp) const {
  // Under sequence parallelism each rank normalised only its rows.
  if (!tp.sequence_parallel()) return;
  tp.all_reduce(w_->grad, ReduceOp::Sum);
  if (b_) tp.all_reduce(b_->grad, ReduceOp::Sum);
}

}  // namespace xirang
