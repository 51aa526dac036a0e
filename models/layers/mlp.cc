#include "models/layers/mlp.h"

namespace xirang {

void Mlp::declare(ParamList& list, const std::string& up_name, const std::string& down_name, int64_t width,
                  int64_t hidden, int layer, InitRule up_init, InitRule down_init) {
  up_.declare(list, up_name, {hidden}, width, layer, up_init);
  down_.declare(list, down_name, width, hidden, layer, down_init);
}

void Mlp::bind(std::vector<Parameter>& params) {
  up_.bind(params);
  down_.bind(params);
}

void Mlp::forward(const KernelContext& ctx, TpComm& tp, Tensor out, Tensor h, Tensor h_gelu, const Tensor& x_full,
                  const Tensor& skip) const {
  up_.forward_gelu(ctx, h_gelu, h, x_full);
  down_.forward(ctx, tp, out, h_gelu, skip);
}

void Mlp::backward(const KernelContext& ctx, TpComm& tp, Tensor dh, const Tensor& dy_full, const Tensor& h,
                   const Tensor& h_gelu, const Tensor& x_full) const {
  down_.backward(ctx, dh, dy_full, h_gelu);
  up_.backward_gelu(ctx, tp.partial(), dh, dh, h, x_full);
}

}  // namespace xirang
