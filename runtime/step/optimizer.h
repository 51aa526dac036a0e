// runtime/step/optimizer.h: AdamW, the learning-rate schedule and global-norm
// clipping.
//
// The optimizer updates a list of segments: (parameter view, gradient view,
// weight decay or not). When the parameters are 16-bit (precision.dtype
// bf16 or fp16) it keeps fp32 master weights per segment next to m and v,
// updates those, and rounds the result into the model's parameters. Without ZeRO a segment is a whole parameter; with
// ZeRO-1 it is the part of a parameter inside this rank's shard of a
// gradient bucket (runtime/step/grad_sync.h builds them), so the optimizer state
// it allocates is only this rank's share. A step is one grouped update
// (kernels/adamw.h: one launch on CUDA over a chunk table carved with the
// state; on the CPU the per-tensor update, segment by segment).
//
//   AdamW opt(cfg.train);
//   opt.set_segments(sync.optimizer_segments());
//   opt.layout_state(state_arena);                 // m and v per segment
//   opt.step(ctx, lr_at(cfg.train, step), clip_scale(cfg.train.grad_clip, norm));
#pragma once

#include <vector>

#include "core/arena.h"
#include "kernels/adamw.h"
#include "kernels/context.h"
#include "models/optimizer_state.h"
#include "runtime/config/config.h"

namespace xirang {

// Linear warmup over warmup_steps (from lr/warmup to lr), then cosine decay
// to lr * min_lr_ratio at the last step. `step` is 0-based.
double lr_at(const TrainConfig& t, int step);
// The factor that scales gradients to a global norm of at most `clip` (1 when clip is 0 or not exceeded).
double clip_scale(double clip, double norm);

struct OptimizerSegment {
  Tensor param;  // 1-D view into the parameter arena
  Tensor grad;   // 1-D view, same length: the (reduced) gradient of those elements
  bool decay;    // weight decay applies
  bool tp_replicated = true;  // every tensor-parallel rank holds the same values (count once in the norm)
  bool tied_copy = false;     // the last stage's copy of the tied token table (not in the norm)
  int param_index = -1;       // the parameter it belongs to
  int64_t param_offset = 0;   // where it starts in that parameter's flat (local) view
};

class AdamW {
 public:
  explicit AdamW(const TrainConfig& cfg) : cfg_(cfg) {}
  void set_segments(std::vector<OptimizerSegment> segments) { segments_ = std::move(segments); }
  const std::vector<OptimizerSegment>& segments() const { return segments_; }
  // Carves m and v (and fp32 master weights under 16-bit parameters) for
  // every segment, and the grouped update's chunk table (call after
  // set_segments, twice: measuring, then real).
  void layout_state(Arena& state);
  // Whether the segments' parameters are 16-bit, so fp32 masters are kept.
  bool has_master() const;
  // Master weights = the current (16-bit) parameters, widened: call after the
  // parameters are initialised, when no checkpoint supplies the masters.
  void init_master(const KernelContext& ctx);
  // One update with learning rate lr; gradients are multiplied by grad_scale
  // first. The moments' bias correction counts the updates made since they
  // started (a skipped fp16 step makes none; a params-only resume starts at 0).
  void step(const KernelContext& ctx, double lr, double grad_scale);
  int64_t updates() const { return state_.updates; }
  void set_updates(int64_t n) { state_.updates = n; }
  // AdamW's first and second moments, one tensor per segment (checkpoints).
  const std::vector<Tensor>& m() const { return m_; }
  const std::vector<Tensor>& v() const { return v_; }
  // fp32 master weights per segment (empty when the parameters are fp32/fp64).
  const std::vector<Tensor>& master() const { return master_; }
  // m, v and the masters as named tensors with the update count, what a
  // checkpoint holds (models/optimizer_state.h): kept current by
  // layout_state and step, valid for the optimizer's life.
  OptimizerState& checkpoint_state() { return state_; }

 private:
  TrainConfig cfg_;
  std::vector<OptimizerSegment> segments_;
  std::vector<Tensor> m_, v_, master_;  // per segment
  std::vector<AdamWTensor> group_;      // per segment: what one step updates
  GroupTable table_;                    // the group's chunk table (kernels/group_table.h)
  OptimizerState state_{"AdamW", {}, 0};  // views of m_, v_, master_; the update count
};

}  // namespace xirang
