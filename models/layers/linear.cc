#include "models/layers/linear.h"

#include <algorithm>
#include <numeric>

#include "kernels/elementwise.h"
#include "kernels/matmul.h"

namespace xirang {

void ColumnParallelLinear::declare(ParamList& list, const std::string& prefix, std::vector<int64_t> out_blocks,
                                   int64_t in, int layer, InitRule init, bool bias) {
  const int64_t out = std::accumulate(out_blocks.begin(), out_blocks.end(), int64_t(0));
  const bool equal = std::all_of(out_blocks.begin(), out_blocks.end(), [&](int64_t b) { return b == out_blocks[0]; });
  const int n = int(out_blocks.size());
  w_ref_ = list.add(prefix + ".weight",
                    equal ? list.split({out, in}, 0, n) : list.split_blocks({out, in}, 0, out_blocks), true, layer,
                    init);
  if (!bias) return;
  b_ref_ = list.add(prefix + ".bias", equal ? list.split({out}, 0, n) : list.split_blocks({out}, 0, out_blocks), false,
                    layer, InitRule::zeros());
}

void ColumnParallelLinear::bind(std::vector<Parameter>& params) {
  w_ = &w_ref_.in(params);
  b_ = b_ref_.declared() ? &b_ref_.in(params) : nullptr;
}

Tensor ColumnParallelLinear::bias_value() const { return b_ ? b_->value : Tensor(); }
Tensor ColumnParallelLinear::bias_grad() const { return b_ ? b_->grad : Tensor(); }

void ColumnParallelLinear::forward(const KernelContext& ctx, Tensor y, const Tensor& x) const {
  linear_forward(ctx, y, x, w_->value, bias_value());
}

void ColumnParallelLinear::forward_gelu(const KernelContext& ctx, Tensor y, Tensor pre, const Tensor& x) const {
  linear_gelu_forward(ctx, y, pre, x, w_->value, bias_value());
}

void ColumnParallelLinear::backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x,
                                    WeightGradQueue* later) const {
  linear_backward(ctx, dx, later ? Tensor() : w_->grad, bias_grad(), dy, x, w_->value, GradMode::Overwrite);
  if (later) later->product(ctx, w_->grad, w_->value, dy, x);
}

void ColumnParallelLinear::backward_gelu(const KernelContext& ctx, Tensor dx, Tensor dpre, const Tensor& dy,
                                         const Tensor& pre, const Tensor& x, WeightGradQueue* later) const {
  linear_gelu_backward(ctx, dx, later ? Tensor() : w_->grad, bias_grad(), dpre, dy, pre, x, w_->value,
                       GradMode::Overwrite);
  if (later) later->product(ctx, w_->grad, w_->value, dpre, x);
}

Tensor ColumnParallelLinear::input_grad(TpComm& tp, Tensor local) {
  if (!tp.split()) return tp.partial();
  // Partial sums over this rank's heads or hidden units.
  tp.reduce_rows(tp.partial(), tp.sequence_parallel() ? local : tp.partial());
  return tp.sequence_parallel() ? local : tp.partial();
}

void RowParallelLinear::declare(ParamList& list, const std::string& prefix, int64_t out, int64_t in, int layer,
                                InitRule init, bool bias) {
  w_ref_ = list.add(prefix + ".weight", list.split({out, in}, 1), true, layer, init);
  if (bias) b_ref_ = list.add(prefix + ".bias", list.whole({out}), false, layer, InitRule::zeros());
}

void RowParallelLinear::bind(std::vector<Parameter>& params) {
  w_ = &w_ref_.in(params);
  b_ = b_ref_.declared() ? &b_ref_.in(params) : nullptr;
}

void RowParallelLinear::forward(const KernelContext& ctx, TpComm& tp, Tensor y, const Tensor& x,
                                const Tensor& skip) const {
  // Partial sums land in the scratch and are reduced into the local rows
  // under sequence parallelism; otherwise the product writes y and is
  // reduced in place.
  const bool via_partial = tp.split() && tp.sequence_parallel();
  Tensor dst = via_partial ? tp.partial() : y;
  linear_forward(ctx, dst, x, w_->value, Tensor());
  tp.reduce_rows(dst, y);
  if (b_) add_bias(ctx, y, b_->value);  // once, after the reduction
  add(ctx, y, y, skip);
}

void RowParallelLinear::forward_unsplit(const KernelContext& ctx, Tensor y, const Tensor& x) const {
  linear_forward(ctx, y, x, w_->value, b_ ? b_->value : Tensor());
}

void RowParallelLinear::backward(const KernelContext& ctx, Tensor dx, const Tensor& dy_full, const Tensor& x,
                                 WeightGradQueue* later) const {
  linear_backward(ctx, dx, later ? Tensor() : w_->grad, b_ ? b_->grad : Tensor(), dy_full, x, w_->value,
                  GradMode::Overwrite);
  if (later) later->product(ctx, w_->grad, w_->value, dy_full, x);
}

}  // namespace xirang
