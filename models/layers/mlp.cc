#include "models/layers/mlp.h"

#include "kernels/elementwise.h"
#include "kernels/swiglu.h"
#include "models/layers/moe_ffn.h"

namespace xirang {

void Mlp::declare(ParamList& list, const std::string& up_name, const std::string& down_name, int64_t width,
                  int64_t hidden, int layer, InitRule up_init, InitRule down_init, bool bias) {
  hidden_ = hidden;
  up_.declare(list, up_name, {hidden}, width, layer, up_init, bias);
  down_.declare(list, down_name, width, hidden, layer, down_init, bias);
}

void Mlp::bind(std::vector<Parameter>& params) {
  up_.bind(params);
  down_.bind(params);
}

void Mlp::activations(ActList& list, FfnActs& a, int64_t rows, int tp, DType dtype) const {
  const bool wide = dtype == DType::F32 || dtype == DType::F64;
  list.push_back({&a.pre, {rows, hidden_ / tp}, false, "mlp hidden", Keep::UnlessFull});
  list.push_back({&a.post, {rows, hidden_ / tp}, false, "mlp gelu", wide ? Keep::UnlessSelective : Keep::UnlessFull});
}

void Mlp::forward_hidden(const KernelContext& ctx, FfnActs& a, const Tensor& x_full) const {
  up_.forward_gelu(ctx, a.post, a.pre, x_full);
}

void Mlp::recompute(const KernelContext& ctx, FfnActs& a) const { gelu_forward(ctx, a.post, a.pre); }

void Mlp::backward(const KernelContext& ctx, TpComm& tp, Tensor scratch, const Tensor& dy_full, const FfnActs& a,
                   const Tensor& x_full, WeightGradQueue* later) const {
  const Tensor dh = scratch.flat().flat_range(0, a.pre.numel()).view(a.pre.shape());  // (N, F/P)
  down_.backward(ctx, dh, dy_full, a.post, later);
  up_.backward_gelu(ctx, tp.partial(), dh, dh, a.pre, x_full, later);
}

void GatedMlp::declare(ParamList& list, const std::string& gate_up_name, const std::string& down_name, int64_t width,
                       int64_t hidden, int layer, InitRule gate_up_init, InitRule down_init, bool bias) {
  hidden_ = hidden;
  gate_up_.declare(list, gate_up_name, {hidden, hidden}, width, layer, gate_up_init, bias);
  down_.declare(list, down_name, width, hidden, layer, down_init, bias);
}

void GatedMlp::bind(std::vector<Parameter>& params) {
  gate_up_.bind(params);
  down_.bind(params);
}

void GatedMlp::activations(ActList& list, FfnActs& a, int64_t rows, int tp, DType) const {
  list.push_back({&a.pre, {rows, 2 * hidden_ / tp}, false, "mlp gate and up", Keep::UnlessFull});
  list.push_back({&a.post, {rows, hidden_ / tp}, false, "mlp swiglu", Keep::UnlessSelective});
}

void GatedMlp::forward_hidden(const KernelContext& ctx, FfnActs& a, const Tensor& x_full) const {
  gate_up_.forward(ctx, a.pre, x_full);
  swiglu_packed_forward(ctx, a.post, a.pre);
}

void GatedMlp::recompute(const KernelContext& ctx, FfnActs& a) const { swiglu_packed_forward(ctx, a.post, a.pre); }

void GatedMlp::backward(const KernelContext& ctx, TpComm& tp, Tensor scratch, const Tensor& dy_full,
                        const FfnActs& a, const Tensor& x_full, WeightGradQueue* later) const {
  const int64_t N = a.post.size(0), Fp = a.post.size(1);
  const Tensor flat = scratch.flat();
  const Tensor dgu = flat.flat_range(0, N * 2 * Fp).view({N, 2 * Fp});
  const Tensor dh = flat.flat_range(N * 2 * Fp, N * 3 * Fp).view({N, Fp});
  down_.backward(ctx, dh, dy_full, a.post, later);
  swiglu_packed_backward(ctx, dgu, dh, a.pre);
  gate_up_.backward(ctx, tp.partial(), dgu, x_full, later);
}

std::unique_ptr<FeedForward> make_feed_forward(FfnKind kind, const MoeDims& moe) {
  if (kind == FfnKind::Moe) return std::make_unique<MoeFeedForward>(moe);
  if (kind == FfnKind::SwiGlu) return std::make_unique<GatedMlp>();
  return std::make_unique<Mlp>();
}

}  // namespace xirang
