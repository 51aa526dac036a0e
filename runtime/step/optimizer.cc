#include "runtime/step/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

#include "kernels/adamw.h"
#include "kernels/elementwise.h"

namespace xirang {

double lr_at(const TrainConfig& t, int step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  const double min_lr = t.lr * t.min_lr_ratio;
  const int decay_steps = t.steps - t.warmup_steps;
  if (decay_steps <= 1) return t.lr;
  const double progress = double(step - t.warmup_steps) / double(decay_steps - 1);
  return min_lr + 0.5 * (t.lr - min_lr) * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

double clip_scale(double clip, double norm) {
  if (clip <= 0 || !(norm > clip)) return 1.0;
  return clip / (norm + 1e-6);
}

bool AdamW::has_master() const {
  return !segments_.empty() && (segments_.front().param.dtype() == DType::BF16 || segments_.front().param.dtype() == DType::F16);
}

void AdamW::layout_state(Arena& state) {
  m_.clear();
  v_.clear();
  master_.clear();
  group_.clear();
  const bool master = has_master();
  int64_t elements = 0;
  for (auto& s : segments_) {
    const DType dt = master ? DType::F32 : s.param.dtype();
    XR_CHECK((s.param.dtype() == DType::BF16 || s.param.dtype() == DType::F16) == master,
             "optimizer segments mix 16-bit and wide parameters");
    m_.push_back(state.alloc(s.param.shape(), dt, "adam m"));
    v_.push_back(state.alloc(s.param.shape(), dt, "adam v"));
    if (master) master_.push_back(state.alloc(s.param.shape(), DType::F32, "master weights"));
    // The fp32 master is updated and rounded into the model's 16-bit weights in one pass.
    if (master)
      group_.push_back({master_.back(), s.grad, m_.back(), v_.back(), s.param, s.decay});
    else
      group_.push_back({s.param, s.grad, m_.back(), v_.back(), Tensor(), s.decay});
    elements += s.param.numel();
  }
  // The checkpoint's view: m and v, then the masters, one slice per segment.
  state_.groups = {{"adam_m", StateFallback::Keep, {}}, {"adam_v", StateFallback::Keep, {}}};
  if (master) state_.groups.push_back({"master", StateFallback::Parameter, {}});
  for (size_t i = 0; i < segments_.size(); ++i) {
    const OptimizerSegment& s = segments_[i];
    state_.groups[0].slices.push_back({s.param_index, s.param_offset, m_[i]});
    state_.groups[1].slices.push_back({s.param_index, s.param_offset, v_[i]});
    if (master) state_.groups[2].slices.push_back({s.param_index, s.param_offset, master_[i]});
  }
  table_ = GroupTable(state.alloc({group_table_words(int64_t(segments_.size()), elements)}, DType::U32,
                                  "AdamW chunk table"));
}

void AdamW::init_master(const KernelContext& ctx) {
  for (size_t i = 0; i < master_.size(); ++i) cast(ctx, master_[i], segments_[i].param);
}

void AdamW::step(const KernelContext& ctx, double lr, double grad_scale) {
  AdamWStep s;
  s.lr = lr;
  s.beta1 = cfg_.beta1;
  s.beta2 = cfg_.beta2;
  s.eps = cfg_.eps;
  s.weight_decay = cfg_.weight_decay;  // on the segments with decay
  s.step = ++state_.updates;
  s.grad_scale = grad_scale;
  adamw_update_group(ctx, group_, s, table_);
}

}  // namespace xirang
