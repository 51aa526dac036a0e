// tests/analysis/published_tables.h: the two published tables `xirang plan`
// is checked against (issue 15; docs/performance_model.md prints them with
// the predictions).
//
// Table 1 of Narayanan et al., "Efficient Large-Scale Language Model
// Training on GPU Clusters Using Megatron-LM" (SC21): A100-80GB, fp16,
// sequence 2048, vocabulary 51200, full recomputation; TFLOP/s per GPU
// count the recomputation (96 B s l h^2 (1 + s/6h + V/16lh) per step).
//
// Megatron-Core r0.8 weak scaling on H100 (bf16, sequence 4096, vocabulary
// 131072, DP 48 except where the GPU count says otherwise, distributed
// optimizer, overlapped gradient reduction, parameter gather and TP
// communication). Micro batch and virtual stages are not published: the
// model assumes one microbatch per step without pipelining (micro batch 4 =
// global batch / dp; the gradient reduction then overlaps the whole
// backward), micro batch 1 with pipelining, and no interleaving (v = 1).
#pragma once

#include <string>
#include <vector>

namespace xirang::analysis::plan::testing {

struct PublishedRow {
  const char* params;
  int layers, hidden, heads, tp, pp, v, dp, gpus, global_batch, micro_batch;
  double tflops;  // per GPU, as published
};

// SC21 Table 1; v from "PP (layers per virtual stage)": v = layers / pp / that.
inline const std::vector<PublishedRow>& megatron_sc21() {
  static const std::vector<PublishedRow> rows = {
      {"1.7B", 24, 2304, 24, 1, 1, 1, 32, 32, 512, 16, 137},
      {"3.6B", 30, 3072, 32, 2, 1, 1, 32, 64, 512, 16, 138},
      {"7.5B", 36, 4096, 32, 4, 1, 1, 32, 128, 512, 16, 142},
      {"18.4B", 40, 6144, 48, 8, 1, 1, 32, 256, 1024, 8, 135},
      {"39.1B", 48, 8192, 64, 8, 2, 1, 32, 512, 1536, 4, 138},
      {"76.1B", 60, 10240, 80, 8, 4, 3, 32, 1024, 1792, 2, 140},
      {"145.6B", 80, 12288, 96, 8, 8, 2, 24, 1536, 2304, 2, 148},
      {"310.1B", 96, 16384, 128, 8, 16, 2, 15, 1920, 2160, 1, 155},
      {"529.6B", 105, 20480, 128, 8, 35, 3, 9, 2520, 2520, 1, 163},
      {"1008B", 128, 25600, 160, 8, 64, 1, 6, 3072, 3072, 1, 163},
  };
  return rows;
}

// Megatron-Core weak scaling; micro batch and `v` assumed (not published; see above).
inline const std::vector<PublishedRow>& megatron_core_h100() {
  static const std::vector<PublishedRow> rows = {
      {"1.7B", 24, 2048, 16, 1, 1, 1, 48, 48, 192, 4, 408.8},
      {"7.1B", 30, 4096, 32, 2, 1, 1, 48, 96, 192, 4, 465.9},
      {"16B", 32, 6144, 48, 4, 1, 1, 48, 192, 192, 4, 489.1},
      {"32B", 48, 7168, 56, 8, 1, 1, 48, 384, 192, 4, 459.6},
      {"70B", 84, 8192, 64, 8, 2, 1, 48, 768, 384, 1, 419.7},
      {"119B", 92, 10240, 80, 8, 4, 1, 48, 1536, 768, 1, 420.5},
      {"177B", 96, 12288, 96, 8, 6, 1, 48, 2304, 1152, 1, 432.8},
      {"314B", 96, 16384, 128, 8, 8, 1, 48, 3072, 1536, 1, 474.4},
      {"462B", 112, 18432, 144, 8, 16, 1, 48, 6144, 3072, 1, 459.9},
  };
  return rows;
}

}  // namespace xirang::analysis::plan::testing
