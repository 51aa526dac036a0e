// ZB-V's compute order (Qi et al. 2024, ZB-V): p ranks with two chunks each
// in a V, found by list scheduling over the passes' times.
//
// Each rank, whenever it is free, starts the first ready pass in the order
// B of chunk 0, B of chunk 1, F of chunk 1, F of chunk 0, W (chunk 0's
// first), keeping at most 2p chunk-microbatches from forward to W (p
// stages' activations, p M_B). Backwards first, so that the gradient
// chain down the V never waits behind a forward; the second chunk's
// forward before the first's, so that microbatches already past the V's
// turn finish before new ones enter; W only where nothing else is ready,
// which is what fills the bubble. A list found this way is free of
// deadlock under any times (each rank's order follows a timeline that met
// every dependency); it is best at the times it was found for. At equal
// times every rank idles (p - 1) chunk forwards per step for m >= 2p (the
// least possible: rank p - 1 waits that long for its first input, then
// has 6m passes); schedule_zbv_test checks that and the rest.
#include "runtime/step/schedule_zbv.h"

#include <array>
#include <cmath>
#include <limits>
#include <set>

#include "core/error.h"

namespace xirang {

std::vector<PipeInstr> zbv_compute_order(int p, int rank, int m, const PassTimes& times) {
  XR_CHECK(times.forward > 0 && times.input > 0 && times.weight > 0 && std::isfinite(times.forward) &&
               std::isfinite(times.input) && std::isfinite(times.weight),
           "zb_v list scheduling needs positive pass times (got F=", times.forward, ", B=", times.input,
           ", W=", times.weight, ")");
  constexpr double kNever = std::numeric_limits<double>::infinity();
  const int chunks = 2 * p, cap = 2 * p;
  const ChunkMap map{p, 2, ChunkOrder::V};
  // Times are sums of the three costs: equal ones may differ in the last bits.
  const double eps = 1e-9 * (times.forward + times.input + times.weight);
  // (2p, m): when the forward / input part of (model chunk, microbatch) ends.
  std::vector<double> f_end(size_t(chunks * m), kNever), b_end(size_t(chunks * m), kNever);
  auto at = [m](int g, int mb) { return size_t(g * m + mb); };
  struct Rank {
    std::array<int, 2> f{0, 0}, b{0, 0}, w{0, 0};  // next microbatch of each pass, per local chunk
    int live = 0;                                   // chunk-microbatches from forward to W
    double free_at = 0;
    std::vector<PipeInstr> order;
  };
  std::vector<Rank> ranks(static_cast<size_t>(p));
  std::set<double> events{0.0};  // times at which a pass ends (a rank frees, an input arrives)
  const long total = 6L * p * m;
  long ran = 0;
  while (ran < total) {
    XR_CHECK(!events.empty(), "zb_v list scheduling stalled (p=", p, ", m=", m, ")");
    const double t = *events.begin();
    events.erase(events.begin());
    for (int r = 0; r < p; ++r) {
      Rank& k = ranks[size_t(r)];
      if (k.free_at > t + eps) continue;
      auto ready_b = [&](int c) {
        const int g = map.model_chunk(r, c), mb = k.b[size_t(c)];
        return mb < k.f[size_t(c)] && (g == chunks - 1 || b_end[at(g + 1, mb)] <= t + eps);
      };
      auto ready_f = [&](int c) {
        const int g = map.model_chunk(r, c), mb = k.f[size_t(c)];
        return mb < m && k.live < cap && (g == 0 || f_end[at(g - 1, mb)] <= t + eps);
      };
      PipeInstr pick{PipeOp::OptimizerStep, -1, -1};  // none ready
      if (ready_b(0)) pick = {PipeOp::BackwardInput, k.b[0], 0};
      else if (ready_b(1)) pick = {PipeOp::BackwardInput, k.b[1], 1};
      else if (ready_f(1)) pick = {PipeOp::Forward, k.f[1], 1};
      else if (ready_f(0)) pick = {PipeOp::Forward, k.f[0], 0};
      else if (k.w[0] < k.b[0]) pick = {PipeOp::BackwardWeight, k.w[0], 0};
      else if (k.w[1] < k.b[1]) pick = {PipeOp::BackwardWeight, k.w[1], 1};
      if (pick.chunk < 0) continue;  // idle until the next event
      const size_t c = size_t(pick.chunk);
      const int g = map.model_chunk(r, pick.chunk);
      double end = t;
      if (pick.op == PipeOp::Forward) {
        end += times.forward;
        f_end[at(g, k.f[c]++)] = end;
        ++k.live;
      } else if (pick.op == PipeOp::BackwardInput) {
        end += times.input;
        b_end[at(g, k.b[c]++)] = end;
      } else {
        end += times.weight;
        ++k.w[c];
        --k.live;
      }
      k.free_at = end;
      events.insert(end);
      ++ran;
      if (r == rank) k.order.push_back(pick);
    }
  }
  return std::move(ranks[size_t(rank)].order);
}

}  // namespace xirang
