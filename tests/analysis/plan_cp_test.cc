// Context parallelism in the performance model: what a cp rank
// communicates (models/layers/cp_comm.h: keys and values all-gathered in
// forward, again in backward, their gradients reduce-scattered, once more
// under recomputation), worked out here by hand; its compute per rank; the
// link its group uses; --layout's cp; and a sequence too long for any
// cp = 1 layout, where the search must pick cp > 1.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "analysis/plan/search.h"
#include "analysis/plan/stage_cost.h"

namespace xirang::analysis::plan {
namespace {

const std::string kSrc = XIRANG_SOURCE_DIR;

// LLaMA 3.1 8B (32 layers, d_model 4096, 32 query heads, 8 key/value heads of 128), bf16.
Workload llama8b(int seq_len, int global_batch) {
  Config c = load_config(kSrc + "/configs/llama3_8b.yaml");
  c.model.max_seq_len = c.train.seq_len = seq_len;
  c.train.global_batch = global_batch;
  return workload_of(c);
}

// H100 nodes with nothing in the step but what a test looks at.
Cluster quiet_h100() {
  Cluster c = load_cluster(kSrc + "/configs/clusters/H100-SXM.yaml");
  c.op_overhead_us = 0;
  c.rank_skew = 0;
  return c;
}

// A ring phase over n ranks: each rank moves (n-1)/n of the buffer, in n-1 latency steps.
double ring_phase(double bytes, int n, const Link& link) {
  return (n - 1.0) / n * bytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6;
}

// tp=2, cp=4, one sequence of 8192 per microbatch: each layer gathers
// 8192 rows x (k and v) x 8/2 kv heads x 128 x 2 bytes = 16,777,216 bytes
// (4 MiB of them this rank's), on NVLink (tp x cp = 8 ranks: one node).
// Per layer and microbatch: a gather in forward, a gather and a
// reduce-scatter in backward; recomputation gathers once more.
TEST(PlanCp, CommVolumeByHand) {
  const Workload w = llama8b(8192, 16);
  const Cluster c = quiet_h100();
  const PlanLayout l = parse_layout("dp=2,cp=4,tp=2,micro_batch=1", {});
  ASSERT_EQ(layout_problem(w, l, c), "");
  EXPECT_DOUBLE_EQ(cp_kv_bytes(w, l), 16777216.0);
  const double one = ring_phase(16777216.0, 4, c.intra_node);  // 34 us of bandwidth + 15 us of latency
  EXPECT_NEAR(one, 0.75 * 16777216.0 / 370e9 + 3 * 5e-6, 1e-15);
  const int microbatches = 16 / 2, layers = 32;
  const Prediction none = predict_time(w, l, c, {});
  EXPECT_NEAR(none.time.cp_comm_s, microbatches * layers * 3 * one, 1e-12);
  for (const char* rc : {"full", "selective"}) {
    const Prediction p = predict_time(w, parse_layout(std::string("recompute=") + rc, l), c, {});
    EXPECT_NEAR(p.time.cp_comm_s, microbatches * layers * 4 * one, 1e-12) << rc;
  }
  // The term is part of the step, and nothing at cp = 1.
  const StepTime& t = none.time;
  EXPECT_NEAR(t.step_s, t.forward_s + t.backward_s + t.recompute_s + t.tp_comm_s + t.cp_comm_s + t.pp_bubble_s +
                            t.pp_comm_exposed_s + t.dp_comm_exposed_s + t.optimizer_s + t.data_wait_s, 1e-12);
  EXPECT_EQ(predict_time(w, parse_layout("dp=8,tp=2", {}), c, {}).time.cp_comm_s, 0);
}

// A cp rank holds T / cp rows of each sequence: its compute (the attention
// core's included) and its tp traffic are those of cp times fewer tokens,
// the same as at cp = 1 with as many tokens per rank.
TEST(PlanCp, ComputeFollowsTheRanksTokens) {
  const Workload w = llama8b(8192, 16);
  const Cluster c = quiet_h100();
  const Prediction one = predict_time(w, parse_layout("dp=2,tp=2,micro_batch=1", {}), c, {});
  const Prediction two = predict_time(w, parse_layout("dp=2,cp=2,tp=2,micro_batch=1", {}), c, {});
  EXPECT_NEAR(two.time.forward_s, 0.5 * one.time.forward_s, 1e-9 * one.time.forward_s);
  EXPECT_NEAR(two.time.backward_s, 0.5 * one.time.backward_s, 1e-9 * one.time.backward_s);
  EXPECT_GT(two.time.tp_comm_s, 0.5 * one.time.tp_comm_s);  // half the bytes; the collectives' latency stays
  EXPECT_LT(two.time.tp_comm_s, 0.55 * one.time.tp_comm_s);
  // Twice the microbatch at cp = 2: as many rows per rank as one sequence at cp = 1, as much compute per microbatch.
  const Prediction same = predict_time(w, parse_layout("dp=2,cp=2,tp=2,micro_batch=2", {}), c, {});
  const int m1 = 16 / (1 * 2), m2 = 16 / (2 * 2);
  EXPECT_NEAR(same.time.forward_s / m2, one.time.forward_s / m1, 1e-9 * one.time.forward_s);
  EXPECT_GT(two.time.cp_comm_s, 0);
}

// The cp group is tp ranks apart (tp, then cp, in the rank order): NVLink
// while its tp x cp ranks fit in a node, the network beyond.
TEST(PlanCp, GroupLinkIsIntraNodeOnlyWhenTpTimesCpFit) {
  const Workload w = llama8b(8192, 16);
  const Cluster c = quiet_h100();  // 8 devices per node
  const PlanLayout inside = parse_layout("dp=2,cp=4,tp=2", {}), across = parse_layout("dp=1,cp=4,tp=4", {});
  EXPECT_EQ(&cp_link(c, inside), &c.intra_node);
  EXPECT_EQ(&cp_link(c, across), &c.inter_node);
  EXPECT_EQ(&cp_link(c, parse_layout("cp=8", {})), &c.intra_node);
  EXPECT_EQ(&cp_link(c, parse_layout("cp=16", {})), &c.inter_node);
  // The term uses it: tp=4, cp=4 (16 ranks) pays the inter-node bandwidth.
  const double bytes = cp_kv_bytes(w, across);
  EXPECT_DOUBLE_EQ(bytes, 8192.0 * 2 * (8 / 4) * 128 * 2);
  const Prediction p = predict_time(w, across, c, {});
  EXPECT_NEAR(p.time.cp_comm_s, 16 * 32 * 3 * ring_phase(bytes, 4, c.inter_node), 1e-12);
}

// Parameters are replicated over cp: the gradients are reduced over the dp
// x cp ranks, as over that many dp ranks, and ZeRO shards over them.
TEST(PlanCp, DataParallelReductionSpansDpTimesCp) {
  const Workload w = llama8b(8192, 16);
  const Cluster c = quiet_h100();
  const Prediction cp = predict_time(w, parse_layout("dp=2,cp=4,tp=2", {}), c, {});
  const Prediction dp = predict_time(w, parse_layout("dp=8,tp=2", {}), c, {});
  EXPECT_GT(cp.time.dp_comm_s, 0);
  EXPECT_DOUBLE_EQ(cp.time.dp_comm_s, dp.time.dp_comm_s);
  EXPECT_GT(predict_time(w, parse_layout("dp=1,cp=2,tp=8", {}), c, {}).time.dp_comm_s, 0);
  const Prediction zero_cp = predict_time(w, parse_layout("dp=2,cp=4,tp=2,zero=1", {}), c, {});
  const Prediction zero_dp = predict_time(w, parse_layout("dp=8,tp=2,zero=1", {}), c, {});
  EXPECT_DOUBLE_EQ(zero_cp.time.optimizer_s, zero_dp.time.optimizer_s);
}

// --layout's cp, the world it counts, and the config's sharding rules in the config's words.
TEST(PlanCp, LayoutParsesCpAndTheRulesAreTheConfigs) {
  const PlanLayout l = parse_layout("dp=2,cp=4,tp=2,pp=2", {});
  EXPECT_EQ(l.cp, 4);
  EXPECT_EQ(l.devices(), 32);
  EXPECT_EQ(parse_layout(l.str(), {}).str(), l.str());
  EXPECT_NE(l.str().find("cp=4"), std::string::npos);
  EXPECT_EQ(parse_layout("dp=2", {}).str().find("cp="), std::string::npos);  // cp = 1 reads as before
  const Workload w = llama8b(8192, 16);
  const Cluster c = quiet_h100();
  EXPECT_EQ(layout_config(w, l).parallel.cp, 4);
  EXPECT_EQ(layout_problem(w, parse_layout("cp=3", {}), c),
            "train.seq_len=8192 is not divisible by 2 x parallel.cp (3) = 6: context parallelism cuts each sequence "
            "into 2 x cp equal chunks");
  EXPECT_EQ(layout_problem(w, parse_layout("cp=0", {}), c), "dp, cp, tp, pp, virtual_stages and micro_batch must be at least 1");
  // Sequence parallelism splits a cp rank's rows over tp: at T = 24 and cp = 2, 12 rows, which tp = 8 does not divide.
  const Workload s = llama8b(24, 16);
  EXPECT_NE(layout_problem(s, parse_layout("cp=2,tp=8,sp=1", {}), c).find("parallel.sequence_parallel splits the 12 token rows"),
            std::string::npos);
  EXPECT_EQ(layout_problem(s, parse_layout("cp=2,tp=4,sp=1", {}), c), "");
}

// A million-token sequence of LLaMA 3.1 8B on 32 H100s: no layout without
// cp fits in 80 GB (even tp = 8 with full recomputation: the last stage's
// logits alone are T x vocabulary / 8 x 4 bytes = 67 GB), and the search
// picks one with cp > 1.
TEST(PlanCp, LongSequenceNeedsCp) {
  const Workload w = llama8b(1 << 20, 32);
  const Cluster c = load_cluster(kSrc + "/configs/clusters/H100-SXM.yaml");
  SearchOptions o;
  o.devices = 32;
  o.top = 3;
  o.max_context_parallel = 1;
  const SearchResult without = search(w, c, o);
  EXPECT_GT(without.candidates, 0);
  EXPECT_TRUE(without.ranked.empty()) << without.ranked.front().layout.str();
  o.max_context_parallel = 16;
  const SearchResult with = search(w, c, o);
  ASSERT_FALSE(with.ranked.empty());
  for (const Prediction& p : with.ranked) {
    EXPECT_GT(p.layout.cp, 1) << p.layout.str();
    EXPECT_TRUE(p.fits);
    EXPECT_GT(p.time.cp_comm_s, 0);
  }
  std::printf("best: %s, %.4g s a step, %.1f GB\n", with.ranked.front().layout.str().c_str(),
              with.ranked.front().time.step_s, double(with.ranked.front().memory_total) / 1e9);
}

// The search simulates only candidates whose bound can still win; its
// ranking (and the count of faster layouts that did not fit) is that of
// simulating every one.
TEST(PlanSearch, PruningKeepsTheRankingOfTimingEveryLayout) {
  struct Case {
    Workload w;
    const char* cluster;
    int devices;
  };
  const Case cases[] = {{workload_of(load_config(kSrc + "/configs/gpt2_124m.yaml")), "A100-80GB", 16},
                        {llama8b(262144, 16), "H100-SXM", 16},
                        {llama8b(8192, 64), "H100-SXM", 32}};
  for (const Case& k : cases) {
    const Cluster c = load_cluster(kSrc + "/configs/clusters/" + k.cluster + ".yaml");
    SearchOptions o;
    o.devices = k.devices;
    o.top = 8;
    const SearchResult pruned = search(k.w, c, o);
    o.prune = false;
    const SearchResult every = search(k.w, c, o);
    ASSERT_EQ(pruned.ranked.size(), every.ranked.size());
    ASSERT_FALSE(every.ranked.empty());
    EXPECT_EQ(pruned.candidates, every.candidates);
    EXPECT_EQ(pruned.rejected_memory, every.rejected_memory);
    for (size_t i = 0; i < every.ranked.size(); ++i) {
      EXPECT_EQ(pruned.ranked[i].layout.str(), every.ranked[i].layout.str()) << i;
      EXPECT_DOUBLE_EQ(pruned.ranked[i].time.step_s, every.ranked[i].time.step_s) << i;
    }
  }
}

}  // namespace
}  // namespace xirang::analysis::plan
