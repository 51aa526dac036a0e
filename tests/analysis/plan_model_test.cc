// The performance model's pieces: collectives, layouts, cluster files,
// memory equal to the trainer's estimate, the simulator's bubble, and the
// calibration on points measured on this machine (tests/assets/sweeps/).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "core/error.h"
#include "runtime/config/schedule_rules.h"
#include "runtime/memory_estimate.h"
#include "analysis/plan/calibrate.h"
#include "analysis/plan/collectives.h"
#include "analysis/plan/search.h"

namespace xirang::analysis::plan {
namespace {

const std::string kSrc = XIRANG_SOURCE_DIR;

Cluster a100() { return load_cluster(kSrc + "/configs/clusters/A100-80GB.yaml"); }

Workload debug_workload() {
  Config c = load_config(kSrc + "/configs/gpt2_debug.yaml");
  return workload_of(c);
}

TEST(PlanCollectives, RingCosts) {
  const Link l{100, 10};  // 100 GB/s, 10 us
  EXPECT_DOUBLE_EQ(all_reduce_s(1e9, 1, l), 0);
  EXPECT_NEAR(all_reduce_s(8e9, 8, l), 2 * (7.0 / 8 * 8e9 / 100e9 + 7 * 10e-6), 1e-12);
  EXPECT_NEAR(reduce_scatter_s(8e9, 8, l) + all_gather_s(8e9, 8, l), all_reduce_s(8e9, 8, l), 1e-12);
}

TEST(PlanLayout, ParsesAndRefuses) {
  const PlanLayout l = parse_layout("tp=2,pp=4,dp=8,virtual_stages=2,micro_batch=2,zero=1,sequence_parallel=1,recompute=full", {});
  EXPECT_EQ(l.devices(), 64);
  EXPECT_TRUE(l.sequence_parallel);
  EXPECT_EQ(l.recompute, Recompute::Full);
  EXPECT_EQ(parse_layout("recompute=selective", l).recompute, Recompute::Selective);
  EXPECT_EQ(parse_layout("recompute=none", l).recompute, Recompute::None);
  EXPECT_EQ(parse_layout("tp=4", l).recompute, Recompute::Full);  // keys not named keep their value
  // The config's words, not numbers.
  try {
    parse_layout("recompute=1", {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Usage);
    EXPECT_EQ(std::string(e.what()), "--layout: recompute=1 is not one of none, selective, full (train.recompute)");
  }
  EXPECT_EQ(parse_layout(l.str(), {}).str(), l.str());
  EXPECT_THROW(parse_layout("tensor=2", {}), Error);
  EXPECT_THROW(parse_layout("tp=two", {}), Error);
}

TEST(PlanLayout, ProblemsNameTheRule) {
  const Workload w = debug_workload();
  EXPECT_NE(layout_problem(w, parse_layout("tp=3", {}), a100()).find("tp=3"), std::string::npos);
  EXPECT_NE(layout_problem(w, parse_layout("pp=3", {}), a100()).find("n_layer"), std::string::npos);
  EXPECT_NE(layout_problem(w, parse_layout("dp=3", {}), a100()).find("global_batch"), std::string::npos);
  EXPECT_EQ(layout_problem(w, parse_layout("dp=2,tp=2,pp=2", {}), a100()), "");
  // The schedule's rules are the config's (runtime/config/schedule_rules.h), in its words.
  Workload six = w;
  six.cfg.train.global_batch = 6;
  EXPECT_EQ(layout_problem(six, parse_layout("pp=4,v=2,micro_batch=1", {}), a100()),
            schedule_problem(ScheduleKind::Interleaved, 4, 2, 6));
  EXPECT_EQ(layout_problem(six, parse_layout("pp=2,v=2,micro_batch=1", {}), a100()), "");
  // A zb_h1 config's pipelined layouts run zb_h1; one stage runs no pipeline (1F1B).
  Workload zb = w;
  zb.cfg.parallel.schedule = ScheduleKind::ZeroBubbleH1;
  EXPECT_EQ(layout_config(zb, parse_layout("pp=2", {})).parallel.schedule, ScheduleKind::ZeroBubbleH1);
  EXPECT_EQ(layout_config(zb, parse_layout("pp=1", {})).parallel.schedule, ScheduleKind::OneFOneB);
  EXPECT_EQ(layout_problem(zb, parse_layout("pp=1", {}), a100()), "");
}

// --layout's recompute takes every spelling of train.recompute, and only those.
TEST(PlanLayout, RecomputeTakesTheConfigsSpellings) {
  for (const char* name : config_names<Recompute>()) {
    const PlanLayout l = parse_layout(std::string("recompute=") + name, {});
    EXPECT_EQ(config_name(l.recompute), std::string(name));
    EXPECT_EQ(parse_layout(l.str(), {}).recompute, l.recompute);
  }
  for (const char* bad : {"0", "2", "Full", "true", ""}) {
    try {
      parse_layout(std::string("recompute=") + bad, {});
      ADD_FAILURE() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Usage);
      EXPECT_EQ(std::string(e.what()), std::string("--layout: recompute=") + bad +
                                           " is not one of none, selective, full (train.recompute)");
    }
  }
}

TEST(PlanCluster, MissingAndUnknownKeysAreConfigErrors) {
  const std::string dir = ::testing::TempDir();
  std::ifstream in(kSrc + "/configs/clusters/H100-SXM.yaml");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(dir + "/missing.yaml") << text.substr(0, text.find("memory_bandwidth_gbps")) << "\n";
  try {
    load_cluster(dir + "/missing.yaml");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("memory_bandwidth_gbps"), std::string::npos) << e.what();
  }
  std::ofstream(dir + "/unknown.yaml") << text << "warp_factor: 9\n";
  EXPECT_THROW(load_cluster(dir + "/unknown.yaml"), Error);
  // The calibration's output reads back to the same constants.
  const Cluster c = load_cluster(kSrc + "/configs/clusters/H100-SXM.yaml");
  std::ofstream(dir + "/round.yaml") << cluster_yaml(c, "# round trip\n");
  EXPECT_EQ(cluster_yaml(load_cluster(dir + "/round.yaml"), ""), cluster_yaml(c, ""));
}

// Memory per device is the trainer's plan for that layout (runtime/memory_estimate.h), plus buffers.
TEST(PlanMemory, EqualsTheTrainersPlan) {
  const Workload w = debug_workload();
  for (const char* text : {"dp=1", "tp=2", "pp=2,dp=2", "pp=2,virtual_stages=2,dp=2,zero=1", "tp=4,sequence_parallel=1"}) {
    Prediction p = predict(w, parse_layout(text, {}), a100(), {});
    ASSERT_TRUE(p.problem.empty()) << text << ": " << p.problem;
    const MemoryPlan want = estimate_peak_memory(layout_config(w, p.layout));
    for (const auto& item : want.items()) EXPECT_EQ(p.memory.bytes_of(item.category), item.bytes) << text << " " << item.category;
  }
}

// The bubble is the simulator's: 1F1B over p stages and m microbatches with
// equal stages is (p-1)/(m+p-1) of the pipeline's time.
TEST(PlanTime, BubbleFollowsTheSchedule) {
  Workload w = debug_workload();
  w.cfg.train.global_batch = 16;
  Cluster c = a100();
  c.op_overhead_us = 0;
  const Prediction p = predict_time(w, parse_layout("pp=4,micro_batch=1", {}), c, {});
  const double pipe = p.time.forward_s + p.time.backward_s + p.time.pp_bubble_s;
  EXPECT_GT(p.time.pp_bubble_s / pipe, 0.5 * 3.0 / 19);
  EXPECT_LT(p.time.pp_bubble_s / pipe, 1.5 * 3.0 / 19);
  const Prediction v2 = predict_time(w, parse_layout("pp=4,virtual_stages=2,micro_batch=1", {}), c, {});
  EXPECT_LT(v2.time.pp_bubble_s, p.time.pp_bubble_s);
}

// Terms add up to the step, and recomputation costs an extra forward of the layers.
TEST(PlanTime, TermsAddUpAndRecomputeCosts) {
  const Workload w = debug_workload();
  const Prediction a = predict_time(w, parse_layout("dp=2,tp=2,pp=2", {}), a100(), {});
  const Prediction b = predict_time(w, parse_layout("dp=2,tp=2,pp=2,recompute=full", {}), a100(), {});
  const StepTime& t = a.time;
  EXPECT_NEAR(t.step_s, t.forward_s + t.backward_s + t.recompute_s + t.tp_comm_s + t.pp_bubble_s + t.pp_comm_exposed_s +
                            t.dp_comm_exposed_s + t.optimizer_s + t.data_wait_s, 1e-15);
  EXPECT_GT(b.time.recompute_s, 0.4 * a.time.forward_s);
  EXPECT_GT(b.time.step_s, a.time.step_s);
  EXPECT_DOUBLE_EQ(a.hardware_tflops, a.model_tflops);
  EXPECT_GT(b.hardware_tflops, 1.2 * b.model_tflops);  // the layers' forward again: a third of their FLOPs
}

// ZB-H1 in the time model: the weight part is a layer's weight-gradient
// products, M FLOPs per token (GPT-2: 24 h^2, as many as the forward's
// products) of a backward of 2 (M + A) (A = 4 T h, the attention core's
// forward), a share of 12 h / (24 h + 4 T); with W below F the bubble
// shrinks, and the step with it.
TEST(PlanTime, ZeroBubbleH1SplitsTheBackwardByItsProducts) {
  Config c = load_config(kSrc + "/configs/gpt2_124m.yaml");
  c.parallel.schedule = ScheduleKind::ZeroBubbleH1;
  const Workload w = workload_of(c);
  const double h = c.model.d_model, T = c.seq_len();
  const Prediction zb = predict(w, parse_layout("dp=8,pp=2", {}), a100(), {});
  std::string note;
  for (const auto& [k, v] : zb.time.notes)
    if (k == "zb_h1") note = v;
  ASSERT_FALSE(note.empty());
  double share = 0;
  ASSERT_EQ(std::sscanf(note.c_str(), "weight part W = %lf", &share), 1) << note;
  EXPECT_NEAR(share, 12 * h / (24 * h + 4 * T), 1e-4);
  c.parallel.schedule = ScheduleKind::OneFOneB;
  const Prediction fb = predict(workload_of(c), parse_layout("dp=8,pp=2", {}), a100(), {});
  EXPECT_LT(zb.time.pp_bubble_s, 0.6 * fb.time.pp_bubble_s);
  EXPECT_LT(zb.time.step_s, fb.time.step_s);
  EXPECT_DOUBLE_EQ(zb.time.forward_s + zb.time.backward_s, fb.time.forward_s + fb.time.backward_s);
}

// ZB-H2 holds 2p - 1 microbatches to fill the warm-up's tail: with the
// step's flush its bubble is (p - 1) max(F, F + B - 2W), below ZB-H1's
// (p - 1)(F + B - W) where W < B (docs/pipeline_schedules.md), at the same
// compute and more activation memory. (LLaMA 3 8B: its stages are even;
// GPT-2's head makes its last stage the bottleneck, which hides the bubble.)
TEST(PlanTime, ZeroBubbleH2BubbleIsBelowZeroBubbleH1s) {
  Config c = load_config(kSrc + "/configs/llama3_8b.yaml");
  const PlanLayout l = parse_layout("dp=2,tp=8,pp=4", {});
  c.parallel.schedule = ScheduleKind::ZeroBubbleH1;
  const Prediction h1 = predict(workload_of(c), l, a100(), {});
  c.parallel.schedule = ScheduleKind::ZeroBubbleH2;
  const Workload w2 = workload_of(c);
  EXPECT_EQ(layout_config(w2, l).parallel.schedule, ScheduleKind::ZeroBubbleH2);
  const Prediction h2 = predict(w2, l, a100(), {});
  bool noted = false;
  for (const auto& [k, v] : h2.time.notes) noted = noted || k == "zb_h2";
  EXPECT_TRUE(noted);
  EXPECT_LT(h2.time.pp_bubble_s, 0.9 * h1.time.pp_bubble_s);
  EXPECT_DOUBLE_EQ(h2.time.forward_s + h2.time.backward_s, h1.time.forward_s + h1.time.backward_s);
  EXPECT_GT(h2.memory_total, h1.memory_total);
}

// Selective recomputation runs each layer's attention core again (4 T H D
// FLOPs per token, the model's own count) and its MLP activation: less than
// a full forward, more than nothing, and its FLOPs are the core's alone.
TEST(PlanTime, SelectiveRecomputationCostsTheAttentionCore) {
  const Workload w = workload_of(load_config(kSrc + "/configs/gpt2_124m.yaml"));
  const ModelDims& d = w.cfg.model;
  const double T = w.cfg.seq_len();
  EXPECT_DOUBLE_EQ(w.attention_flops_per_token, 4.0 * T * d.n_head * d.head_size());
  EXPECT_DOUBLE_EQ(w.ffn_width, 4.0 * d.d_model);
  const Prediction none = predict_time(w, parse_layout("dp=16,tp=2,pp=2", {}), a100(), {});
  const Prediction sel = predict_time(w, parse_layout("dp=16,tp=2,pp=2,recompute=selective", {}), a100(), {});
  const Prediction full = predict_time(w, parse_layout("dp=16,tp=2,pp=2,recompute=full", {}), a100(), {});
  EXPECT_GT(sel.time.recompute_s, 0);
  EXPECT_LT(sel.time.recompute_s, 0.5 * full.time.recompute_s);  // at s = 1024, h = 768 the core is ~ a fifth of a layer's FLOPs
  EXPECT_GT(sel.time.step_s, none.time.step_s);
  EXPECT_LT(sel.time.step_s, full.time.step_s);
  EXPECT_DOUBLE_EQ(sel.time.tp_comm_s, none.time.tp_comm_s);  // no collective is run again
  // Hardware FLOPs: the model's plus the core's forward, for every token and layer.
  const double extra = sel.hardware_tflops / sel.model_tflops - 1;
  EXPECT_NEAR(extra, w.attention_flops_per_token / (w.layer_flops_per_token + w.head_flops_per_token / d.n_layer),
              1e-9);
  // The term follows the core's share: four times the sequence, more than four times the recomputation's share.
  Config longer = w.cfg;
  longer.model.max_seq_len = longer.train.seq_len = 4 * int(T);
  const Workload w4 = workload_of(longer);
  EXPECT_DOUBLE_EQ(w4.attention_flops_per_token, 4 * w.attention_flops_per_token);
}

// Points measured on this machine (`xirang sweep
// configs/sweeps/calibrate_this_machine.yaml`: 18 two-rank gpt2_debug
// trainings, dp, tp and pp alternating over six shapes, 5 repeats in
// rounds of 10 measured steps, at priority -15); the even ones are fitted,
// the odd ones predicted.
std::vector<SweepPoint> this_machine_points() {
  return read_sweep(kSrc + "/tests/assets/sweeps/this_machine.jsonl");
}
Cluster this_machine() { return load_cluster(kSrc + "/configs/clusters/this_machine.yaml"); }

double median_error(const std::vector<SweepPoint>& pts, const Cluster& c) {
  std::vector<double> e;
  for (const SweepPoint& p : pts) e.push_back(std::fabs(predict_point(p, c) / p.step_s - 1));
  std::sort(e.begin(), e.end());
  return e[e.size() / 2];
}

// The fit moves the constants toward the measurements.
TEST(PlanCalibration, FitImprovesOnTheStartingFile) {
  const auto points = this_machine_points();
  const CalibrationResult r = calibrate(points, this_machine(), Holdout::Odd);
  std::printf("%s", calibration_report(r).c_str());
  EXPECT_LT(r.fit_median_error, 0.12);
  EXPECT_LT(median_error(points, r.cluster), median_error(points, this_machine()));
}

// A sweep of model shapes at one layout (the data-parallel points): the
// held-out half within 15% each, median under 10%.
TEST(PlanCalibration, PredictsHeldOutDataParallelPoints) {
  std::vector<SweepPoint> dp;
  for (const SweepPoint& p : this_machine_points())
    if (p.layout.dp > 1) dp.push_back(p);
  ASSERT_EQ(dp.size(), 6u);
  const CalibrationResult r = calibrate(dp, this_machine(), Holdout::Odd);
  std::printf("%s", calibration_report(r).c_str());
  for (const PointError& e : r.held_out) EXPECT_LT(std::fabs(e.error()), 0.15) << e.id;
  EXPECT_LT(r.held_out_median_error, 0.10);
}

// The bubble sweep (pp=2, one shape, 1 to 16 microbatches: the
// simulator's pipeline against measured steps): the held-out half within
// 15% each, median under 10%.
TEST(PlanCalibration, PredictsHeldOutPipelinePoints) {
  const auto points = read_sweep(kSrc + "/tests/assets/sweeps/this_machine_pipeline.jsonl");
  ASSERT_EQ(points.size(), 8u);
  const CalibrationResult r = calibrate(points, this_machine(), Holdout::Odd);
  std::printf("%s", calibration_report(r).c_str());
  for (const PointError& e : r.held_out) EXPECT_LT(std::fabs(e.error()), 0.15) << e.id;
  EXPECT_LT(r.held_out_median_error, 0.10);
}

// The bar over all layouts at once: the held-out half (every layout, both
// sequence lengths) within 15% each, median under 10%.
TEST(PlanCalibration, PredictsHeldOutPointsOfAllLayouts) {
  const auto points = this_machine_points();
  const CalibrationResult r = calibrate(points, this_machine(), Holdout::Odd);
  std::printf("%s", calibration_report(r).c_str());
  for (const PointError& e : r.held_out) EXPECT_LT(std::fabs(e.error()), 0.15) << e.id;
  EXPECT_LT(r.held_out_median_error, 0.10);
}

// The backward's time per forward comes from the fitted rows' breakdowns
// (their median), not from the fit; the held-out rows do not count.
TEST(PlanCalibration, BackwardFactorIsTheFittedRowsMedianRatio) {
  const auto points = this_machine_points();
  std::vector<double> ratios;
  for (size_t i = 0; i < points.size(); i += 2) {
    ASSERT_GT(points[i].backward_ratio, 0) << points[i].id;
    ratios.push_back(points[i].backward_ratio);
  }
  std::sort(ratios.begin(), ratios.end());
  const CalibrationResult r = calibrate(points, this_machine(), Holdout::Odd);
  EXPECT_EQ(r.backward_points, 9);
  EXPECT_DOUBLE_EQ(r.cluster.backward_factor, ratios[4]);
  EXPECT_GT(r.cluster.backward_factor, 1.0);  // this CPU: about 1.47, not a GPU's 2
  EXPECT_LT(r.cluster.backward_factor, 2.0);
  EXPECT_NE(calibration_report(r).find("backward_factor"), std::string::npos);
}

// A row's compute (forward_ms + backward_ms) is fitted as well as its step
// time: a fit of the step times alone trades a wrong compute rate against
// the communication terms. With it, every fitted row's compute is close.
TEST(PlanCalibration, FitsTheComputeOfEveryRow) {
  const auto points = this_machine_points();
  const CalibrationResult r = calibrate(points, this_machine(), Holdout::Odd);
  for (size_t i = 0; i < points.size(); ++i) {
    const StepTime t = predict_point_times(points[i], r.cluster);
    ASSERT_GT(points[i].compute_s, 0);
    EXPECT_LT(std::fabs(t.first_stage_compute_s / points[i].compute_s - 1), 0.15) << points[i].id;
  }
}

// A row's train.recompute is the layout's (and a recomputing backward,
// holding a forward or its attention core, gives no backward ratio); a
// value that is none of the three is a Data error naming it.
TEST(PlanCalibration, ReadsTheRecomputeOfARow) {
  const std::string dir = ::testing::TempDir();
  std::ifstream in(kSrc + "/tests/assets/sweeps/this_machine.jsonl");
  std::string row;
  std::getline(in, row);
  const std::string none = "\"recompute\":\"none\"";
  const size_t at = row.find(none);
  ASSERT_NE(at, std::string::npos) << row;
  auto with = [&](const std::string& value) {
    std::string r = row;
    r.replace(at, none.size(), "\"recompute\":\"" + value + "\"");
    std::ofstream(dir + "/rc.jsonl") << r << "\n" << r << "\n";  // the reader wants two rows or more
    return read_sweep(dir + "/rc.jsonl");
  };
  EXPECT_EQ(with("none").at(0).layout.recompute, Recompute::None);
  EXPECT_GT(with("none").at(0).backward_ratio, 0);
  const SweepPoint full = with("full").at(0);
  EXPECT_EQ(full.layout.recompute, Recompute::Full);
  EXPECT_LT(full.backward_ratio, 0);
  EXPECT_GT(full.compute_s, 0);
  const SweepPoint selective = with("selective").at(0);
  EXPECT_EQ(selective.layout.recompute, Recompute::Selective);
  EXPECT_LT(selective.backward_ratio, 0);
  EXPECT_GT(selective.compute_s, 0);  // compared with the model's selective term
  try {
    with("sometimes");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Data);
    EXPECT_NE(std::string(e.what()).find("layout.recompute is 'sometimes'"), std::string::npos) << e.what();
  }
}

// Points that waited for a core are named in the report, with a warning.
TEST(PlanCalibration, ReportNamesContendedPoints) {
  auto points = this_machine_points();
  CalibrationResult quiet = calibrate(points, this_machine(), Holdout::Odd);
  EXPECT_EQ(quiet.contended_points, 0);
  EXPECT_EQ(calibration_report(quiet).find("warning"), std::string::npos);
  points[1].cpu_wait_share = 0.4;
  points[2].cpu_wait_share = 0.05;  // under the threshold
  const CalibrationResult r = calibrate(points, this_machine(), Holdout::Odd);
  EXPECT_EQ(r.contended_points, 1);
  const std::string report = calibration_report(r);
  EXPECT_NE(report.find("warning: 1 point(s) waited for a core"), std::string::npos) << report;
  EXPECT_NE(report.find(points[1].id + " "), std::string::npos);
  EXPECT_NE(report.find("(waited for a core 40% of the step)"), std::string::npos) << report;
}

}  // namespace
}  // namespace xirang::analysis::plan
