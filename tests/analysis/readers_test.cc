// The sweeps' and the report's readers of metrics.jsonl, reached without
// the command line: a step's times land in the report's parts by the table
// of the step's times (runtime/observe/step_fields.h), and a sweep's
// breakdown is every time of that table but step_ms.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "analysis/report/report.h"
#include "analysis/report/trace.h"
#include "analysis/sweep/sweep.h"
#include "runtime/observe/step_fields.h"

namespace xirang::analysis {
namespace {

std::string write_metrics(const std::string& name, int steps) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("xirang_readers_" + name);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "metrics.jsonl").string();
  std::ofstream out(path);
  for (int s = 1; s <= steps; ++s)
    out << "{\"step\":" << s << ",\"loss\":" << 5.0 - 0.1 * s << ",\"tokens_per_s\":1000,\"step_ms\":100,"
        << "\"mfu\":0.3,\"forward_ms\":20,\"backward_ms\":40,\"optimizer_ms\":5,\"data_wait_ms\":3,"
        << "\"dp_comm_ms\":30,\"dp_comm_exposed_ms\":7,\"tp_comm_ms\":11,\"pp_bubble_ms\":6,"
        << "\"pp_comm_exposed_ms\":2,\"ckpt_stall_ms\":1,\"unaccounted_ms\":5}\n";
  return path;
}

TEST(ReportReader, PartsComeFromTheTableOfTheStepsTimes) {
  const report::Run run = report::load_run(write_metrics("parts", 4));
  ASSERT_EQ(run.steps.size(), 4u);
  const report::StepRow& r = run.steps[1];
  using report::Part;
  EXPECT_EQ(r.ms[int(Part::Compute)], 60);  // forward + backward
  EXPECT_EQ(r.ms[int(Part::Optimizer)], 5);
  EXPECT_EQ(r.ms[int(Part::DataWait)], 3);
  EXPECT_EQ(r.ms[int(Part::DpExposed)], 7);
  EXPECT_EQ(r.ms[int(Part::TpComm)], 11);
  EXPECT_EQ(r.ms[int(Part::PpBubble)], 6);
  EXPECT_EQ(r.ms[int(Part::PpExposed)], 2);
  EXPECT_EQ(r.ms[int(Part::CkptStall)], 1);
  EXPECT_EQ(r.ms[int(Part::Unaccounted)], 5);  // step_ms less the parts
  EXPECT_EQ(r.dp_comm_ms, 30);                  // beside the parts, not one of them
  const report::Summary s = report::summarise(run);
  double shares = 0;
  for (double x : s.share) shares += x;
  EXPECT_NEAR(shares, 1, 1e-12);
}

TEST(SweepReader, TheBreakdownIsEveryTimeButTheStep) {
  std::string expected;
  for (const StepField& f : step_fields())
    if (f.kind != StepField::Kind::Total) expected += std::string(f.key) + " ";
  std::string got;
  for (const std::string& k : sweep::breakdown_keys()) got += k + " ";
  EXPECT_EQ(got, expected);
  EXPECT_EQ(got.find("step_ms "), std::string::npos);
}

// The utilisation table names ranks by (dp,tp,pp), and by (dp,cp,tp,pp) once a rank has a cp place.
TEST(ReportUtilisation, RankLabelsNameCpOnlyWhereItIsUsed) {
  using namespace report;
  Utilisation u;
  u.ranks.resize(2);
  u.ranks[1].rank = 1, u.ranks[1].dp = 0, u.ranks[1].tp = 1, u.ranks[1].pp = 0;
  EXPECT_FALSE(has_cp(u));
  EXPECT_EQ(rank_axis(false), "rank (dp,tp,pp)");
  EXPECT_EQ(rank_label(u.ranks[1], has_cp(u)), "1 (0,1,0)");
  u.ranks[1].rank = 3, u.ranks[1].cp = 1;
  EXPECT_TRUE(has_cp(u));
  EXPECT_EQ(rank_axis(true), "rank (dp,cp,tp,pp)");
  EXPECT_EQ(rank_label(u.ranks[1], true), "3 (0,1,1,0)");
  EXPECT_EQ(rank_label(u.ranks[0], true), "0 (0,0,0,0)");
}

}  // namespace
}  // namespace xirang::analysis
