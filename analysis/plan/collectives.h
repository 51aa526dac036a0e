// analysis/plan/collectives.h: ring collective times (alpha-beta model).
//
// A ring over n ranks moves (n-1)/n of the buffer per phase through each
// rank's link and takes n-1 steps of latency per phase; an all-reduce is
// a reduce-scatter phase and an all-gather phase.
//
//   double t = all_reduce_s(bytes, 8, cluster.intra_node);
#pragma once

#include "analysis/plan/cluster.h"

namespace xirang::analysis::plan {

inline double ring_phase_s(double bytes, int n, const Link& link) {
  if (n <= 1) return 0;
  return double(n - 1) / n * bytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6;
}
inline double all_reduce_s(double bytes, int n, const Link& link) { return 2 * ring_phase_s(bytes, n, link); }
inline double reduce_scatter_s(double bytes, int n, const Link& link) { return ring_phase_s(bytes, n, link); }
inline double all_gather_s(double bytes, int n, const Link& link) { return ring_phase_s(bytes, n, link); }
// One point-to-point message.
inline double send_s(double bytes, const Link& link) { return link.latency_us * 1e-6 + bytes / (link.bandwidth_gbps * 1e9); }

}  // namespace xirang::analysis::plan
