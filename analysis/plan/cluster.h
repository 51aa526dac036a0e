// analysis/plan/cluster.h: a cluster description for `xirang plan`.
//
// One YAML file per machine type (configs/clusters/): devices per node, the
// device's peak dense matrix throughput, memory and memory bandwidth, the
// links inside and between nodes, and a few efficiency constants that say
// how much of those peaks the runtime reaches. The performance model
// (analysis/plan/cost_model.h) reads nothing else about the hardware;
// `xirang plan --calibrate` writes the same format with fitted constants.
//
//   Cluster c = load_cluster("configs/clusters/H100-SXM.yaml");   // Config error naming a missing key
//   double t = c.matmul_seconds(flops, /*width=*/8192, /*fp32=*/false);
#pragma once

#include <string>

namespace xirang::analysis::plan {

struct Link {
  double bandwidth_gbps = 0;  // GB/s per device, one direction, as collectives reach it (bus bandwidth)
  double latency_us = 0;      // per collective step (a ring has n-1 of them per phase)
};

struct Cluster {
  std::string name;
  std::string source;           // the file it came from
  int devices_per_node = 8;
  int nodes = 0;                // 0: as many as a layout needs
  double peak_tflops = 0;       // dense bf16/fp16 matrix throughput per device (datasheet)
  double peak_tflops_fp32 = 0;  // fp32 matrix throughput (no TF32); 0: peak_tflops
  double memory_gb = 0;         // per device, GB (1e9 bytes)
  double memory_reserved_gb = 0;  // not available to the arenas: context, library workspaces, fragmentation
  double memory_bandwidth_gbps = 0;  // GB/s
  Link intra_node, inter_node;
  // Efficiency: achieved = peak x constant. The matrix units reach
  // matmul_efficiency x w / (w + matmul_half_width) of peak on products
  // whose inner width is w (the hidden size): small products waste more.
  double matmul_efficiency = 0.7;
  double matmul_half_width = 0;  // 0: no size dependence
  double memory_efficiency = 0.8;  // element-wise kernels and the optimizer, of memory_bandwidth_gbps
  double op_overhead_us = 0;       // per layer, microbatch and forward pass (launches, small ops); backward: backward_factor x
  double comm_buffer_mb = 0;       // per communication group with more than one rank (library buffers)
  // How far, as a fraction of its compute time, the slowest data-parallel
  // rank finishes behind the others (noise, shared cores): the others wait
  // for it in the gradient reduction. 0 on dedicated machines; fitted here.
  double rank_skew = 0;
  // A backward pass's compute time per forward pass of the same work. 2
  // where the backward's two products per forward product run at the
  // forward's rate (GPUs); a CPU measures less (about 1.47 on this
  // machine: its forward carries element-wise work at a lower rate than the
  // products).
  // `--calibrate` sets it to the median backward_ms / forward_ms of the
  // sweep's points.
  double backward_factor = 2;

  // Seconds for `flops` of matrix products of inner width `width`.
  double matmul_seconds(double flops, double width, bool fp32) const;
  // Seconds to stream `bytes` through memory in element-wise kernels.
  double memory_seconds(double bytes) const;
  double usable_memory_bytes() const { return (memory_gb - memory_reserved_gb) * 1e9; }
};

// Reads and checks a cluster file: every required key present and positive,
// unknown keys refused (a Config error naming the file and the key).
Cluster load_cluster(const std::string& path);
// YAML text of `c` (the calibration writes it).
std::string cluster_yaml(const Cluster& c, const std::string& comment);

}  // namespace xirang::analysis::plan
