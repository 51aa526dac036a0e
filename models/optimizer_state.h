// models/optimizer_state.h: an optimizer's state as named tensors, which a
// checkpoint saves and a resume restores without knowing the optimizer.
//
// The state is a list of groups, each named as its checkpoint group
// ("adam_m", "adam_v", "master"); a group holds one tensor per optimizer
// segment, in segment order (every group the same segments), each a view of
// the elements [param_offset, param_offset + n) of one parameter's flat
// local view. The optimizer owns the state and keeps it current (the views
// follow its state arena; `updates` is its own count), so a reference to it
// stays valid for the optimizer's life; whoever restores it writes through
// the views.
//
//   OptimizerState& s = opt.checkpoint_state();
//   for (size_t i = 0; i < s.segments(); ++i)
//     for (const OptimizerStateGroup& g : s.groups)
//       save(g.name, params[g.slices[i].param_index], g.slices[i].param_offset, g.slices[i].data);
//   save_scalar("optimizer.updates", s.updates);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace xirang {

// What a state tensor holds after resuming a checkpoint that lacks its group.
enum class StateFallback {
  Keep,       // the optimizer's own start (zeroed moments): a parameters-only checkpoint
  Parameter,  // the checkpoint's parameter values, widened (fp32 master weights)
};

// One segment's part of a group: elements of one parameter.
struct OptimizerStateSlice {
  int param_index = -1;      // the parameter (in the trainer's arena order) whose elements it holds
  int64_t param_offset = 0;  // where they start in that parameter's flat local view
  Tensor data;               // (n) a view into the optimizer's state arena
};

struct OptimizerStateGroup {
  std::string name;  // the checkpoint group: "adam_m"
  StateFallback fallback = StateFallback::Keep;
  std::vector<OptimizerStateSlice> slices;  // one per segment, in segment order
};

struct OptimizerState {
  std::string optimizer;                   // how messages name it: "AdamW"
  std::vector<OptimizerStateGroup> groups;  // e.g. adam_m, adam_v, then master under 16-bit parameters
  int64_t updates = 0;                      // updates made since the moments started (bias correction)

  // The segment count every group shares (0 without groups).
  size_t segments() const { return groups.empty() ? 0 : groups.front().slices.size(); }
};

}  // namespace xirang
