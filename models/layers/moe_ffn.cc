#include "models/layers/moe_ffn.h"

#include <algorithm>

#include "core/device_memory.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "kernels/moe.h"
#include "kernels/swiglu.h"

namespace xirang {

namespace {

// "a.b.c" -> "a.b"
std::string parent(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

}  // namespace

MoeFeedForward::MoeFeedForward(const MoeDims& moe) : moe_(moe) {
  XR_CHECK(moe.num_experts >= 1 && moe.top_k >= 1 && moe.top_k <= moe.num_experts, "MoeFeedForward: ",
           moe.num_experts, " experts, top_k ", moe.top_k, " (expected 1 <= top_k <= num_experts)");
  if (moe.shared_hidden > 0) shared_ = std::make_unique<GatedMlp>();
  bias_host_.assign(size_t(moe.num_experts), 0.0);
  loads_.assign(size_t(moe.num_experts), 0);
  offsets_host_.assign(size_t(moe.num_experts) + 1, 0);
}

RouterOptions MoeFeedForward::router_options() const {
  return {.score = moe_.score, .top_k = moe_.top_k, .normalize = moe_.normalize, .force_balance = moe_.force_balance};
}

void MoeFeedForward::declare(ParamList& list, const std::string& up_name, const std::string& down_name, int64_t width,
                             int64_t hidden, int layer, InitRule up_init, InitRule down_init, bool bias) {
  XR_CHECK(list.tp() == 1, "MoeFeedForward: no tensor parallelism inside the experts yet (tp ", list.tp(), ")");
  const int64_t E = moe_.num_experts;
  C_ = width;
  hidden_ = hidden;
  const std::string base = parent(parent(up_name));  // "layers.0.mlp"
  // The router reads the residual stream like the up-projections do.
  router_ref_ = list.add(base + ".gate.weight", list.whole({E, width}), true, layer, up_init);
  gate_up_ref_ = list.add(up_name + ".weight", list.whole({E, width, 2 * hidden}), true, layer, up_init);
  down_ref_ = list.add(down_name + ".weight", list.whole({E, hidden, width}), true, layer, down_init);
  if (shared_)
    shared_->declare(list, base + ".shared_expert.gate_up_proj", base + ".shared_expert.down_proj", width,
                     moe_.shared_hidden, layer, up_init, down_init, bias);
}

void MoeFeedForward::bind(std::vector<Parameter>& params) {
  router_ = &router_ref_.in(params);
  gate_up_ = &gate_up_ref_.in(params);
  expert_down_ = &down_ref_.in(params);
  if (shared_) shared_->bind(params);
}

void MoeFeedForward::activations(ActList& list, FfnActs& a, int64_t rows, int tp, DType dtype) const {
  const int64_t E = moe_.num_experts, k = moe_.top_k, F = hidden_, C = C_, R = rows * k;
  const DType rdt = dtype == DType::F64 ? DType::F64 : DType::F32;
  MoeActs& m = a.moe;
  // Routing is cheap to redo but its indices decide every product: kept
  // unless the whole block is recomputed.
  if (dtype == DType::BF16 || dtype == DType::F16)
    list.push_back({&m.x32, {rows, C}, false, "moe router input", Keep::UnlessFull, DType::F32});
  list.push_back({&m.scores, {rows, E}, false, "moe scores", Keep::UnlessFull, rdt});
  list.push_back({&m.ids, {rows, k}, false, "moe expert ids", Keep::UnlessFull, DType::I32});
  list.push_back({&m.gates, {rows, k}, false, "moe gates", Keep::UnlessFull, rdt});
  list.push_back({&m.sorted_slots, {R}, false, "moe sorted slots", Keep::UnlessFull, DType::I32});
  list.push_back({&m.slot_rows, {R}, false, "moe slot rows", Keep::UnlessFull, DType::I32});
  list.push_back({&m.offsets, {E + 1}, false, "moe expert offsets", Keep::UnlessFull, DType::I32});
  list.push_back({&m.xp, {R, C}, false, "moe expert rows", Keep::UnlessFull});
  list.push_back({&m.gu, {R, 2 * F}, false, "moe expert gate and up", Keep::UnlessFull});
  list.push_back({&m.h, {R, F}, false, "moe expert swiglu", Keep::UnlessFull});
  list.push_back({&m.yp, {R, C}, false, "moe expert outputs", Keep::UnlessFull});
  if (shared_) shared_->activations(list, a, rows, tp, dtype);
}

void MoeFeedForward::layout_state(Arena& acts, int64_t rows, int64_t sequence_rows, DType dtype) {
  const int64_t E = moe_.num_experts, k = moe_.top_k;
  dtype_ = dtype;
  rows_ = rows;
  sequence_rows_ = sequence_rows;
  const DType rdt = route_dtype();
  bias_ = acts.alloc({E}, rdt, "moe selection bias");
  logits_ = acts.alloc({rows, E}, rdt, "moe router logits");
  dlogits_ = acts.alloc({rows, E}, rdt, "moe router logit gradient");
  dgates_ = acts.alloc({rows, k}, rdt, "moe gate gradient");
  routed_ = acts.alloc({rows, C_}, dtype, "moe routed output");
  bias_ready_ = false;
  w32_ = sixteen() ? acts.alloc({E, C_}, DType::F32, "moe router weight (f32)") : Tensor();
  dx32_ = sixteen() ? acts.alloc({rows, C_}, DType::F32, "moe router input gradient (f32)") : Tensor();
}

int64_t MoeFeedForward::scratch_width(int) const {
  // dyp then dxp (k C), dh (k F), dgu (k 2F), the routed input gradient (C);
  // the shared experts' backward runs first over the same columns.
  const int64_t routed = moe_.top_k * (C_ + 3 * hidden_) + C_;
  return std::max(routed, shared_ ? shared_->scratch_width(1) : int64_t(0));
}

double MoeFeedForward::active_matrix_params() const {
  return double(moe_.top_k) * 3.0 * double(C_) * double(hidden_) + 3.0 * double(C_) * double(moe_.shared_hidden) +
         double(moe_.num_experts) * double(C_);
}

Tensor MoeFeedForward::host_offsets(const KernelContext& ctx, const Tensor& offsets) const {
  if (offsets.device() == Device::CPU) return offsets;
  // The grouped products choose their shapes on the host: one small read back per pass.
  copy_bytes(offsets_host_.data(), Device::CPU, offsets.raw(), offsets.device(), offsets.bytes(), ctx.cuda_stream,
             true);
  return Tensor(offsets_host_.data(), offsets.shape(), DType::I32, Device::CPU);
}

void MoeFeedForward::router_logits(const KernelContext& ctx, const MoeActs& m, const Tensor& x_full) const {
  if (!sixteen()) {
    linear_forward(ctx, logits_, x_full, router_->value, Tensor());
    return;
  }
  // 16-bit storage: the product in f32 of the rows and weight widened (the
  // weight's f32 master lives in the optimizer).
  cast(ctx, m.x32, x_full);
  cast(ctx, w32_, router_->value);
  linear_forward(ctx, logits_, m.x32, w32_, Tensor());
}

void MoeFeedForward::begin_forward(double dloss) { dloss_ = dloss; }

void MoeFeedForward::forward_hidden(const KernelContext& ctx, FfnActs& a, const Tensor& x_full) const {
  const MoeActs& m = a.moe;
  if (!bias_ready_) upload_bias(ctx);
  router_logits(ctx, m, x_full);
  router_forward(ctx, m.ids, m.gates, m.scores, Tensor(), logits_, bias_, router_options());
  moe_permutation(ctx, m.sorted_slots, m.slot_rows, m.offsets, m.ids, moe_.num_experts);
  const Tensor offsets = host_offsets(ctx, m.offsets);
  moe_permute(ctx, m.xp, x_full, m.sorted_slots);
  grouped_matmul_forward(ctx, m.gu, m.xp, gate_up_->value, offsets);
  swiglu_packed_forward(ctx, m.h, m.gu);
  grouped_matmul_forward(ctx, m.yp, m.h, expert_down_->value, offsets);
  if (shared_) shared_->forward_hidden(ctx, a, x_full);
}

void MoeFeedForward::forward(const KernelContext& ctx, TpComm& tp, Tensor out, FfnActs& a, const Tensor& x_full,
                             const Tensor& skip) const {
  XR_CHECK(rows_ > 0, "MoeFeedForward: forward before layout_state()");
  forward_hidden(ctx, a, x_full);
  const MoeActs& m = a.moe;
  if (dloss_ > 0) {
    // Loads from the offsets the products read (already on the host).
    const Tensor offsets = m.offsets.device() == Device::CPU
                               ? m.offsets
                               : Tensor(offsets_host_.data(), m.offsets.shape(), DType::I32, Device::CPU);
    const int32_t* o = offsets.data<int32_t>();
    for (size_t e = 0; e < loads_.size(); ++e) loads_[e] += o[e + 1] - o[e];
    if (moe_.aux_loss != MoeAuxLoss::None) {
      const int64_t groups = moe_.aux_loss == MoeAuxLoss::Sequence ? rows_ / sequence_rows_ : 1;
      aux_sum_ += router_aux_loss(ctx, Tensor(), m.ids, m.scores, groups, moe_.aux_loss_coeff, 0.0, router_options());
    }
  }
  moe_unpermute_combine(ctx, routed_, m.yp, m.gates, m.slot_rows);
  if (shared_) {
    shared_->down().forward(ctx, tp, out, a.post, skip);  // skip + shared(x)
    add(ctx, out, out, routed_);
  } else {
    add(ctx, out, skip, routed_);
  }
}

void MoeFeedForward::recompute(const KernelContext& ctx, FfnActs& a) const {
  if (shared_) shared_->recompute(ctx, a);
}

void MoeFeedForward::router_backward_into(const KernelContext& ctx, Tensor dx, const MoeActs& m,
                                          const Tensor& x_full) const {
  // dx (N, C) += dlogits W_r; dW_r += dlogits^T x, in the routing dtype.
  if (!sixteen()) {
    linear_backward(ctx, dx, router_->grad, Tensor(), dlogits_, x_full, router_->value, GradMode::Accumulate);
    return;
  }
  cast(ctx, w32_, router_->value);
  linear_backward(ctx, dx32_, router_->grad, Tensor(), dlogits_, m.x32, w32_, GradMode::Overwrite);
  cast(ctx, routed_, dx32_);  // routed_ is free in backward
  add(ctx, dx, dx, routed_);
}

void MoeFeedForward::backward(const KernelContext& ctx, TpComm& tp, Tensor scratch, const Tensor& dy_full,
                              const FfnActs& a, const Tensor& x_full, WeightGradQueue* later) const {
  XR_CHECK(!later, "the MoE feed-forward has no split backward yet (parallel.schedule zb_*)");
  const MoeActs& m = a.moe;
  const int64_t N = dy_full.size(0), R = m.xp.size(0), C = C_, F = hidden_;
  const Tensor flat = scratch.flat();
  const Tensor dyp = flat.flat_range(0, R * C).view({R, C});  // then dxp
  const Tensor dh = flat.flat_range(R * C, R * (C + F)).view({R, F});
  const Tensor dgu = flat.flat_range(R * (C + F), R * (C + 3 * F)).view({R, 2 * F});
  const Tensor dxe = flat.flat_range(R * (C + 3 * F), R * (C + 3 * F) + N * C).view({N, C});
  Tensor dx = tp.partial();  // (N, C)
  if (shared_) shared_->backward(ctx, tp, scratch, dy_full, a, x_full, nullptr);  // dx = the shared experts'

  // The mirror of forward: combine, down product, SwiGLU, gate/up product, permutation.
  const Tensor offsets = host_offsets(ctx, m.offsets);
  moe_unpermute_combine_backward(ctx, dyp, dgates_, dy_full, m.yp, m.gates, m.slot_rows);
  grouped_matmul_backward(ctx, dh, expert_down_->grad, dyp, m.h, expert_down_->value, offsets, GradMode::Overwrite);
  swiglu_packed_backward(ctx, dgu, dh, m.gu);
  grouped_matmul_backward(ctx, dyp, gate_up_->grad, dgu, m.xp, gate_up_->value, offsets, GradMode::Overwrite);
  if (shared_) {
    moe_permute_backward(ctx, dxe, dyp, m.slot_rows);
    add(ctx, dx, dx, dxe);
  } else {
    moe_permute_backward(ctx, dx, dyp, m.slot_rows);
  }

  // The router: through the gates, plus the balance loss's gradient.
  router_backward(ctx, dlogits_, dgates_, m.ids, m.scores, router_options());
  if (moe_.aux_loss != MoeAuxLoss::None) {
    const int64_t groups = moe_.aux_loss == MoeAuxLoss::Sequence ? rows_ / sequence_rows_ : 1;
    router_aux_loss(ctx, dlogits_, m.ids, m.scores, groups, moe_.aux_loss_coeff, dloss_ * double(N),
                    router_options());
  }
  router_backward_into(ctx, dx, m, x_full);
}

double MoeFeedForward::take_aux_loss() {
  const double s = aux_sum_;
  aux_sum_ = 0;
  return s;
}

double MoeFeedForward::last_imbalance() const {
  int64_t total = 0, most = 0;
  for (int64_t c : last_loads_) total += c, most = std::max(most, c);
  return total > 0 ? double(most) * double(last_loads_.size()) / double(total) : 0.0;
}

void MoeFeedForward::set_bias(const std::vector<double>& bias) {
  XR_CHECK(bias.size() == bias_host_.size(), "MoeFeedForward::set_bias: ", bias.size(), " values for ",
           bias_host_.size(), " experts");
  bias_host_ = bias;
  bias_ready_ = false;
}

void MoeFeedForward::upload_bias(const KernelContext& ctx) const {
  bias_ready_ = true;
  if (route_dtype() == DType::F64) {
    copy_bytes(bias_.raw(), bias_.device(), bias_host_.data(), Device::CPU, bias_.bytes(), ctx.cuda_stream, true);
  } else {
    std::vector<float> f(bias_host_.begin(), bias_host_.end());
    copy_bytes(bias_.raw(), bias_.device(), f.data(), Device::CPU, bias_.bytes(), ctx.cuda_stream, true);
  }
}

void MoeFeedForward::end_step(const KernelContext& ctx) {
  last_loads_ = loads_;
  std::fill(loads_.begin(), loads_.end(), 0);
  int64_t total = 0;
  for (int64_t c : last_loads_) total += c;
  if (moe_.bias_update_rate <= 0 || total == 0) return;
  // DeepSeek-V3 sec 2.1.2: an overloaded expert's bias falls by gamma, an underloaded one's rises.
  const double mean = double(total) / double(last_loads_.size());
  std::vector<double> next = bias_host_;
  for (size_t e = 0; e < next.size(); ++e) {
    const double load = double(last_loads_[e]);
    next[e] += moe_.bias_update_rate * (load < mean ? 1.0 : load > mean ? -1.0 : 0.0);
  }
  set_bias(next);
  upload_bias(ctx);
}

}  // namespace xirang
