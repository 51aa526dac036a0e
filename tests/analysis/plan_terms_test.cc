// Two step-time terms of the performance model against their formulas,
// worked out here from the model's size and the cluster's constants rather
// than through the model's own functions (docs/performance_model.md): the
// data-parallel reduction's exposed time, and the pipeline bubble. The
// published tables and the calibration points are too coarse to notice
// either one being wrong (tests/analysis/plan_tables_test.cc,
// plan_model_test.cc).
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "analysis/plan/cost_model.h"

namespace xirang::analysis::plan {
namespace {

const std::string kSrc = XIRANG_SOURCE_DIR;

Workload debug_workload(int global_batch) {
  Config c = load_config(kSrc + "/configs/gpt2_debug.yaml");
  c.train.global_batch = global_batch;
  return workload_of(c);
}

// A100 nodes with nothing in the step but what a test looks at.
Cluster quiet_a100() {
  Cluster c = load_cluster(kSrc + "/configs/clusters/A100-80GB.yaml");
  c.op_overhead_us = 0;
  c.rank_skew = 0;
  return c;
}

// The gradients the model reduces: the first pipeline stage's, those of
// gpt2_debug (h = 64, 8 layers, 256 tokens, 64 positions) without pipeline
// stages. Per layer two LayerNorms (2h each), the qkv projection (h x 3h +
// 3h), the attention output (h x h + h), the MLP (h x 4h + 4h, 4h x h + h);
// besides the layers the token and position tables (the head is tied to the
// token table; the final LayerNorm's 2h belong to the last stage, which the
// model leaves out).
constexpr double kH = 64, kLayers = 8, kVocab = 256, kPositions = 64;
constexpr double kLayerParams = 2 * 2 * kH + (3 * kH * kH + 3 * kH) + (kH * kH + kH) + (4 * kH * kH + 4 * kH) +
                                (4 * kH * kH + kH);
constexpr double kEndsParams = kVocab * kH + kPositions * kH;
constexpr double kParams = kLayers * kLayerParams + kEndsParams;  // 420352

// A ring phase over n ranks: each rank sends (n-1)/n of the buffer, in n-1
// steps of the link's latency; an all-reduce is two phases.
double ring_phase(double bytes, int n, const Link& link) {
  return (n - 1.0) / n * bytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6;
}
double ring_all_reduce(double bytes, int n, const Link& link) { return 2 * ring_phase(bytes, n, link); }

TEST(PlanDpTerm, CountsTheFirstStagesParameters) {
  const Workload w = debug_workload(8);
  EXPECT_DOUBLE_EQ(w.layer_params, kLayerParams);
  EXPECT_DOUBLE_EQ(w.ends_params, kEndsParams);
}

// Without overlap nothing hides the reduction: all of it is exposed, an
// all-reduce of every fp32 gradient, inside a node for dp=4 and over the
// network for dp=16 (more ranks than a node's 8 devices).
TEST(PlanDpTerm, WithoutOverlapTheWholeAllReduceIsExposed) {
  Workload w = debug_workload(16);
  w.cfg.parallel.overlap_grad_reduce = false;
  const Cluster c = quiet_a100();
  for (int dp : {4, 16}) {
    const Prediction p = predict_time(w, parse_layout(str_cat("dp=", dp), {}), c, {});
    ASSERT_TRUE(p.problem.empty()) << p.problem;
    const Link& link = dp > c.devices_per_node ? c.inter_node : c.intra_node;
    const double want = ring_all_reduce(4 * kParams, dp, link);
    EXPECT_NEAR(p.time.dp_comm_s, want, 1e-12 * want) << "dp=" << dp;
    EXPECT_NEAR(p.time.dp_comm_exposed_s, want, 1e-12 * want) << "dp=" << dp;
  }
  // One rank reduces nothing.
  EXPECT_EQ(predict_time(w, parse_layout("dp=1", {}), c, {}).time.dp_comm_exposed_s, 0);
}

// ZeRO-1 reduce-scatters the fp32 gradients and all-gathers the updated
// 16-bit parameters: one phase each, of different sizes.
TEST(PlanDpTerm, ZeroReduceScattersGradientsAndGathersParameters) {
  Workload w = debug_workload(16);
  w.cfg.parallel.overlap_grad_reduce = false;
  w.cfg.precision.dtype = Precision::BF16;
  const Cluster c = quiet_a100();
  const Prediction p = predict_time(w, parse_layout("dp=4,zero=1", {}), c, {});
  ASSERT_TRUE(p.problem.empty()) << p.problem;
  const double want = ring_phase(4 * kParams, 4, c.intra_node) + ring_phase(2 * kParams, 4, c.intra_node);
  EXPECT_NEAR(p.time.dp_comm_exposed_s, want, 1e-12 * want);
}

// With overlap, buckets reduce during the last microbatch's backward: what
// the step waits for is whichever is longer, the last bucket's all-reduce
// (it starts when the backward ends) or what the backward cannot cover.
TEST(PlanDpTerm, WithOverlapTheBackwardHidesAllButTheRest) {
  Workload w = debug_workload(16);
  w.cfg.parallel.bucket_mb = 0.25;  // 16 buckets
  const double grads = 4 * kParams, bucket = 0.25 * 1024 * 1024;
  ASSERT_GT(grads / bucket, 6);
  const int dp = 4, m = 16 / dp;
  const PlanLayout l = parse_layout(str_cat("dp=", dp), {});

  // Slow compute: the backward covers every bucket but the last.
  Cluster slow_compute = quiet_a100();
  slow_compute.peak_tflops_fp32 = 1e-4;
  Prediction p = predict_time(w, l, slow_compute, {});
  ASSERT_TRUE(p.problem.empty()) << p.problem;
  const double all = ring_all_reduce(grads, dp, slow_compute.intra_node);
  ASSERT_GT(p.time.backward_s / m, all);
  double want = ring_all_reduce(bucket, dp, slow_compute.intra_node);
  EXPECT_NEAR(p.time.dp_comm_s, all, 1e-12 * all);
  EXPECT_NEAR(p.time.dp_comm_exposed_s, want, 1e-12 * want);

  // A slow link: the backward (one microbatch's, one stage) hides its own length of the reduction.
  Cluster slow_link = quiet_a100();
  slow_link.intra_node.bandwidth_gbps = 0.01;
  p = predict_time(w, l, slow_link, {});
  const double window = p.time.backward_s / m;
  want = ring_all_reduce(grads, dp, slow_link.intra_node) - window;
  ASSERT_GT(window, 0);
  ASSERT_GT(want, ring_all_reduce(bucket, dp, slow_link.intra_node));
  EXPECT_NEAR(p.time.dp_comm_exposed_s, want, 1e-12 * want);
}

// The bubble of 1F1B with equal stages: the first microbatch's forward
// reaches the last stage after p-1 stage-forwards, and the last backward
// returns to the first after p-1 stage-backwards, so each stage idles
// (p-1) x (f + b) of a pipeline whose busiest stage works m x (f + b):
// (p-1)/m of the forward and backward time. The stages are made equal
// here: no head FLOPs, and element-wise work (the embedding, the loss) free.
TEST(PlanBubble, OneFOneBIdlesPMinusOneOverMOfTheCompute) {
  Cluster c = quiet_a100();
  c.memory_bandwidth_gbps = 1e30;
  for (auto [pp, m] : {std::pair{2, 1}, {2, 8}, {4, 4}, {4, 16}, {8, 8}}) {
    Workload w = debug_workload(m);
    w.head_flops_per_token = 0;
    const Prediction p = predict_time(w, parse_layout(str_cat("pp=", pp), {}), c, {});
    ASSERT_TRUE(p.problem.empty()) << p.problem;
    const StepTime& t = p.time;
    const double want = double(pp - 1) / m * (t.forward_s + t.backward_s);
    EXPECT_NEAR(t.pp_bubble_s, want, 1e-9 * want) << "pp=" << pp << " m=" << m;
  }
}

// Interleaving v chunks per stage cuts the warm-up and drain to chunk
// passes: the bubble is (p-1)/(v m) of the compute.
TEST(PlanBubble, InterleavedIdlesPMinusOneOverVmOfTheCompute) {
  Cluster c = quiet_a100();
  c.memory_bandwidth_gbps = 1e30;
  for (auto [pp, m] : {std::pair{2, 2}, {2, 8}, {4, 4}, {4, 8}}) {
    Workload w = debug_workload(m);
    w.head_flops_per_token = 0;
    const Prediction p = predict_time(w, parse_layout(str_cat("pp=", pp, ",virtual_stages=2"), {}), c, {});
    ASSERT_TRUE(p.problem.empty()) << p.problem;
    const StepTime& t = p.time;
    const double want = double(pp - 1) / (2 * m) * (t.forward_s + t.backward_s);
    EXPECT_NEAR(t.pp_bubble_s, want, 1e-9 * want) << "pp=" << pp << " m=" << m;
  }
}

}  // namespace
}  // namespace xirang::analysis::plan
