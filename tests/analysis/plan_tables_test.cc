// `xirang plan` against published results (issue 15): every row of both
// tables within 15% of the published TFLOP/s per GPU, with one cluster file
// per cluster; and for every row a recommended layout at least as fast as
// the published one, with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "tests/analysis/published_tables.h"
#include "analysis/plan/search.h"

namespace xirang::analysis::plan {
namespace {

using testing::PublishedRow;

constexpr double kTolerance = 0.15;

Cluster cluster(const char* name) {
  return load_cluster(std::string(XIRANG_SOURCE_DIR) + "/configs/clusters/" + name + ".yaml");
}

Workload workload(const PublishedRow& r, int seq, int vocab, Precision prec) {
  Config c;
  c.model.arch = "gpt2";
  c.model.n_layer = r.layers;
  c.model.d_model = r.hidden;
  c.model.n_head = r.heads;
  c.model.max_seq_len = seq;
  c.model.vocab_size = vocab;
  c.train.global_batch = r.global_batch;
  c.precision.dtype = prec;
  return workload_of(c);
}

struct Table {
  const char* title;
  const std::vector<PublishedRow>& rows;
  const char* cluster;
  int seq, vocab;
  Precision prec;
  bool recompute;
  int zero;
  Features features;
};

Table sc21() { return {"Megatron-LM SC21 Table 1 (A100-80GB)", testing::megatron_sc21(), "A100-80GB", 2048, 51200, Precision::FP16, true, 0, {}}; }
Table mcore() {
  return {"Megatron-Core r0.8 weak scaling (H100)", testing::megatron_core_h100(), "H100-SXM", 4096, 131072,
          Precision::BF16, false, 1, {true, true}};
}

PlanLayout published_layout(const Table& t, const PublishedRow& r) {
  return PlanLayout{r.dp, r.tp, r.pp, r.v, r.micro_batch, t.zero, false, t.recompute ? Recompute::Full : Recompute::None};
}

// The TFLOP/s the table counts: with recomputation's extra forward when the runs recomputed.
double counted_tflops(const Table& t, const Prediction& p) { return t.recompute ? p.hardware_tflops : p.model_tflops; }

void check_table(const Table& t) {
  const Cluster c = cluster(t.cluster);
  std::printf("%s\n%-8s %-32s %9s %9s %7s %6s %s\n", t.title, "model", "layout", "published", "predicted", "error",
              "mem GB", "largest terms");
  std::vector<double> errors;
  for (const PublishedRow& r : t.rows) {
    const Workload w = workload(r, t.seq, t.vocab, t.prec);
    const Prediction p = predict(w, published_layout(t, r), c, t.features);
    ASSERT_TRUE(p.problem.empty()) << r.params << ": " << p.problem;
    const double pred = counted_tflops(t, p), err = pred / r.tflops - 1;
    errors.push_back(std::fabs(err));
    std::printf("%-8s tp%d pp%d v%d dp%d mb%d %13s %9.1f %9.1f %+6.1f%% %6.1f  bubble %.0f%% tp %.0f%% dp %.0f%%\n",
                r.params, r.tp, r.pp, r.v, r.dp, r.micro_batch, "", r.tflops, pred, 100 * err,
                double(p.memory_total) / 1e9, 100 * p.time.pp_bubble_s / p.time.step_s,
                100 * p.time.tp_comm_s / p.time.step_s, 100 * p.time.dp_comm_exposed_s / p.time.step_s);
    EXPECT_LT(std::fabs(err), kTolerance) << t.title << " " << r.params << ": predicted " << pred << " TFLOP/s, published "
                                          << r.tflops;
  }
  std::sort(errors.begin(), errors.end());
  std::printf("max |error| %.1f%%, median %.1f%%\n\n", 100 * errors.back(), 100 * errors[errors.size() / 2]);
}

TEST(PlanPublished, MegatronSc21Table1WithinTolerance) { check_table(sc21()); }
TEST(PlanPublished, MegatronCoreH100WithinTolerance) { check_table(mcore()); }

void check_recommendations(const Table& t) {
  const Cluster c = cluster(t.cluster);
  for (const PublishedRow& r : t.rows) {
    const Workload w = workload(r, t.seq, t.vocab, t.prec);
    const Prediction pub = predict(w, published_layout(t, r), c, t.features);
    SearchOptions o;
    o.devices = r.gpus;
    o.top = 1;
    o.features = t.features;
    const SearchResult s = search(w, c, o);
    ASSERT_FALSE(s.ranked.empty()) << r.params << ": no layout fits";
    const Prediction& best = s.ranked.front();
    std::printf("%-8s published %-80s %.4g tokens/s%s\n         recommended %-78s %.4g tokens/s: %s\n", r.params,
                pub.layout.str().c_str(), pub.tokens_per_s, pub.fits ? "" : " (does not fit)",
                best.layout.str().c_str(), best.tokens_per_s, compare(best, pub).c_str());
    EXPECT_GE(best.tokens_per_s, pub.tokens_per_s * (1 - 1e-12)) << r.params;
  }
}

TEST(PlanPublished, RecommendsAtLeastThePublishedLayoutSc21) { check_recommendations(sc21()); }
TEST(PlanPublished, RecommendsAtLeastThePublishedLayoutMegatronCore) { check_recommendations(mcore()); }

}  // namespace
}  // namespace xirang::analysis::plan
