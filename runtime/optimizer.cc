#include "runtime/optimizer.h"

#include <cmath>

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

void AdamW::layout_state(Arena& state) {
  m_.clear();
  v_.clear();
  for (auto& s : segments_) {
    m_.push_back(state.alloc(s.param.shape(), s.param.dtype(), "adam m"));
    v_.push_back(state.alloc(s.param.shape(), s.param.dtype(), "adam v"));
  }
}

void AdamW::step(const KernelContext& ctx, int64_t step_number, double lr, double grad_scale) {
  for (size_t i = 0; i < segments_.size(); ++i) {
    AdamWStep s;
    s.lr = lr;
    s.beta1 = cfg_.beta1;
    s.beta2 = cfg_.beta2;
    s.eps = cfg_.eps;
    s.weight_decay = segments_[i].decay ? cfg_.weight_decay : 0.0;
    s.step = step_number;
    s.grad_scale = grad_scale;
    adamw_update(ctx, segments_[i].param, segments_[i].grad, m_[i], v_[i], s);
  }
}

}  // namespace xirang
