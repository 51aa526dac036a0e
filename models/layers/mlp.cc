#include "models/layers/mlp.h"

#include "kernels/swiglu.h"

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
  forward_hidden(ctx, h, h_gelu, x_full);
  down_.forward(ctx, tp, out, h_gelu, skip);
}

void Mlp::forward_hidden(const KernelContext& ctx, Tensor h, Tensor h_gelu, const Tensor& x_full) const {
  up_.forward_gelu(ctx, h_gelu, h, x_full);
}

void Mlp::backward(const KernelContext& ctx, TpComm& tp, Tensor dh, const Tensor& dy_full, const Tensor& h,
                   const Tensor& h_gelu, const Tensor& x_full) const {
  down_.backward(ctx, dh, dy_full, h_gelu);
  up_.backward_gelu(ctx, tp.partial(), dh, dh, h, x_full);
}

void GatedMlp::declare(ParamList& list, const std::string& gate_up_name, const std::string& down_name, int64_t width,
                       int64_t hidden, int layer, InitRule gate_up_init, InitRule down_init) {
  gate_up_.declare(list, gate_up_name, {hidden, hidden}, width, layer, gate_up_init, /*bias=*/false);
  down_.declare(list, down_name, width, hidden, layer, down_init, /*bias=*/false);
}

void GatedMlp::bind(std::vector<Parameter>& params) {
  gate_up_.bind(params);
  down_.bind(params);
}

void GatedMlp::forward(const KernelContext& ctx, TpComm& tp, Tensor out, Tensor gu, Tensor h, const Tensor& x_full,
                       const Tensor& skip) const {
  forward_hidden(ctx, gu, h, x_full);
  down_.forward(ctx, tp, out, h, skip);
}

void GatedMlp::forward_hidden(const KernelContext& ctx, Tensor gu, Tensor h, const Tensor& x_full) const {
  gate_up_.forward(ctx, gu, x_full);
  swiglu_packed_forward(ctx, h, gu);
}

void GatedMlp::backward(const KernelContext& ctx, TpComm& tp, Tensor dgu, Tensor dh, const Tensor& dy_full,
                        const Tensor& gu, const Tensor& h, const Tensor& x_full) const {
  down_.backward(ctx, dh, dy_full, h);
  swiglu_packed_backward(ctx, dgu, dh, gu);
  gate_up_.backward(ctx, tp.partial(), dgu, x_full);
}

}  // namespace xirang
