// runtime/optimizer.h: AdamW over a model's parameters, the learning-rate
// schedule, and global-norm gradient clipping.
//
//   AdamW opt(model.parameters(), cfg.train);
//   opt.layout_state(state_arena);                    // m and v, like the parameters
//   double norm = opt.grad_norm(ctx);
//   opt.step(ctx, step, lr_at(cfg.train, step), clip_scale(cfg.train.grad_clip, norm));
#pragma once

#include <vector>

#include "kernels/context.h"
#include "models/gpt2.h"
#include "runtime/config.h"

namespace xirang {

// Linear warmup over warmup_steps (from lr/warmup to lr), then cosine decay
// to lr * min_lr_ratio at the last step. `step` is 0-based.
double lr_at(const TrainConfig& t, int step);
// The factor that scales gradients to a global norm of at most `clip` (1 when clip is 0 or not exceeded).
double clip_scale(double clip, double norm);

class AdamW {
 public:
  AdamW(std::vector<Parameter>& params, const TrainConfig& cfg);
  void layout_state(Arena& state);
  // sqrt of the sum of squares of every gradient.
  double grad_norm(const KernelContext& ctx) const;
  // One update with learning rate lr; gradients are multiplied by grad_scale first.
  void step(const KernelContext& ctx, int64_t step_number, double lr, double grad_scale);
  void zero_grads(const KernelContext& ctx);

 private:
  std::vector<Parameter>& params_;
  TrainConfig cfg_;
  std::vector<Tensor> m_, v_;  // per parameter, same shapes
};

}  // namespace xirang
