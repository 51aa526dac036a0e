// The per-rank trace file (runtime/observe/trace_writer.h): its metadata, one
// process per rank named by its coordinates, lanes that keep overlapping
// transfers apart, microsecond times, and the trace window's opening and
// closing. Multi-rank traces and `xirang trace merge` are tested in
// tests/cli/trace_test.sh.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/observe/trace_writer.h"
#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

using nlohmann::json;
using testing_util::fresh_test_dir;

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

TraceRankInfo info_of_rank(int rank) {
  TraceRankInfo info;
  info.world_rank = rank;
  info.world_size = 8;
  info.coords = GridCoords{1, 0, 1};
  info.job = "unit";
  info.first_step = 2;
  info.last_step = 3;
  info.clock_sync_s = 100.25;
  return info;
}

// The thread name of every tid, and the X events.
struct Parsed {
  std::map<int, std::string> threads;
  std::vector<json> spans;
  std::string process;
};

Parsed parse(const json& doc) {
  Parsed p;
  for (const json& e : doc.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") p.threads[e.at("tid")] = e.at("args").at("name");
    if (e.at("ph") == "M" && e.at("name") == "process_name") p.process = e.at("args").at("name");
    if (e.at("ph") == "X") p.spans.push_back(e);
  }
  return p;
}

TEST(TraceWriter, WritesMetadataAndMicrosecondSpans) {
  const std::string dir = fresh_test_dir("trace");
  std::vector<Span> spans = {{"step", Track::Main, -1, -1, 2, -1, 100.5, 100.6},
                             {"forward", Track::Main, 1, 3, -1, -1, 100.51, 100.52}};
  const std::string path = write_rank_trace(dir, info_of_rank(5), spans);
  EXPECT_EQ(path, dir + "/rank_00005.json");
  const json doc = read_json(path);
  const json& other = doc.at("otherData");
  EXPECT_EQ(other.at("format"), "xirang-trace-1");
  EXPECT_EQ(other.at("rank"), 5);
  EXPECT_EQ(other.at("world_size"), 8);
  EXPECT_EQ(other.at("dp"), 1);
  EXPECT_EQ(other.at("pp"), 1);
  EXPECT_DOUBLE_EQ(other.at("clock_sync_us").get<double>(), 100.25e6);
  const Parsed p = parse(doc);
  EXPECT_EQ(p.process, "rank 5 (dp 1, tp 0, pp 1)");
  ASSERT_EQ(p.spans.size(), 2u);
  EXPECT_EQ(p.spans[0].at("name"), "step");
  EXPECT_EQ(p.spans[0].at("args").at("step"), 2);
  EXPECT_EQ(p.spans[0].at("pid"), 5);
  EXPECT_NEAR(p.spans[0].at("ts").get<double>(), 100.5e6, 1e-3);
  EXPECT_NEAR(p.spans[0].at("dur").get<double>(), 0.1e6, 1e-3);
  EXPECT_EQ(p.spans[1].at("args").at("microbatch"), 1);
  EXPECT_EQ(p.spans[1].at("args").at("chunk"), 3);
  EXPECT_EQ(p.threads.at(p.spans[1].at("tid")), "compute");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(TraceWriter, OverlappingTransfersGetLanesAndNestedSpansDoNot) {
  const std::string dir = fresh_test_dir("trace");
  // Buckets 0 and 1 overlap, bucket 2 starts after bucket 0 ended: two lanes.
  std::vector<Span> spans = {{"dp_all_reduce", Track::DpComm, -1, -1, 0, 64, 1.0, 1.5},
                             {"dp_all_reduce", Track::DpComm, -1, -1, 1, 64, 1.1, 1.8},
                             {"dp_all_reduce", Track::DpComm, -1, -1, 2, 64, 1.6, 1.7},
                             {"backward", Track::Main, 0, 0, -1, -1, 0.9, 1.9},
                             {"tp_all_reduce", Track::Main, -1, -1, -1, -1, 1.2, 1.3}};
  const Parsed p = parse(read_json(write_rank_trace(dir, info_of_rank(0), spans)));
  std::map<int, int> bucket_tid;
  std::set<int> main_tids;
  for (const json& s : p.spans) {
    if (s.at("name") == "dp_all_reduce") bucket_tid[s.at("args").at("index")] = s.at("tid");
    else main_tids.insert(s.at("tid").get<int>());
    EXPECT_GE(s.at("dur").get<double>(), 0);
  }
  EXPECT_NE(bucket_tid[0], bucket_tid[1]);
  EXPECT_EQ(bucket_tid[2], bucket_tid[0]);
  EXPECT_EQ(p.threads.at(bucket_tid[0]), "dp reductions");
  EXPECT_EQ(p.threads.at(bucket_tid[1]), "dp reductions #2");
  EXPECT_EQ(main_tids.size(), 1u);  // the collective nests inside the pass on one row
  for (const json& s : p.spans)
    if (s.at("name") == "dp_all_reduce") {
      EXPECT_EQ(s.at("args").at("bytes"), 64);
    }
}

TEST(TraceWriter, UnwritableDirectoryIsAConfigError) {
  const std::string dir = fresh_test_dir("trace");
  std::filesystem::create_directories(dir);
  const std::string file = dir + "/a_file";
  std::ofstream(file) << "x";
  ASSERT_TRUE(std::filesystem::is_regular_file(file));
  try {
    write_rank_trace(file + "/sub", info_of_rank(0), {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("metrics.trace"), std::string::npos) << e.what();
  }
}

// The window on one rank: spans before its first step are dropped, the file
// is written after its last step, and tracing stops there.
TEST(TraceWindow, OpensAtTheFirstStepAndWritesAfterTheLast) {
  const std::string dir = fresh_test_dir("trace");
  MetricsConfig mc;
  mc.trace = dir;
  mc.trace_steps.first = 2;
  mc.trace_steps.last = 3;
  auto grid = ProcessGrid::single();
  TraceWindow w(mc, *grid);
  Timeline tl;
  for (int step = 1; step <= 5; ++step) {
    w.before_step(step, tl);
    EXPECT_EQ(tl.tracing(), step == 2 || step == 3) << step;
    { SpanScope s(&tl, "step", Track::Main, -1, -1, step); }
    w.after_step(step, tl);
  }
  w.finish(tl);
  EXPECT_FALSE(tl.tracing());
  const json doc = read_json(w.last_path());
  EXPECT_EQ(doc.at("otherData").at("first_step"), 2);
  EXPECT_EQ(doc.at("otherData").at("last_step"), 3);
  std::vector<int> steps;
  for (const json& s : parse(doc).spans) steps.push_back(s.at("args").at("step"));
  EXPECT_EQ(steps, (std::vector<int>{2, 3}));
}

TEST(TraceWindow, TrainingThatEndsInsideTheWindowWritesWhatItHas) {
  const std::string dir = fresh_test_dir("trace");
  MetricsConfig mc;
  mc.trace = dir;
  mc.trace_steps.first = 2;
  mc.trace_steps.last = 10;
  auto grid = ProcessGrid::single();
  TraceWindow w(mc, *grid);
  Timeline tl;
  for (int step = 1; step <= 4; ++step) {
    w.before_step(step, tl);
    { SpanScope s(&tl, "step", Track::Main, -1, -1, step); }
    w.after_step(step, tl);
  }
  EXPECT_TRUE(tl.tracing());
  w.finish(tl);
  EXPECT_FALSE(tl.tracing());
  const json doc = read_json(w.last_path());
  EXPECT_EQ(doc.at("otherData").at("last_step"), 4);
  EXPECT_EQ(parse(doc).spans.size(), 3u);
}

// A span of another thread begun inside the window (a checkpoint write)
// holds the file back until it ends; spans of later steps are left out.
TEST(TraceWindow, WaitsForASpanBegunInsideTheWindow) {
  const std::string dir = fresh_test_dir("trace");
  MetricsConfig mc;
  mc.trace = dir;
  mc.trace_steps.first = 1;
  mc.trace_steps.last = 2;
  auto grid = ProcessGrid::single();
  TraceWindow w(mc, *grid);
  Timeline tl;
  std::optional<SpanScope> write;
  for (int step = 1; step <= 4; ++step) {
    w.before_step(step, tl);
    { SpanScope s(&tl, "step", Track::Main, -1, -1, step); }
    if (step == 2) write.emplace(&tl, "checkpoint_write", Track::Checkpoint, -1, -1, 2);
    if (step == 3) write.reset();  // the write ends during step 3
    w.after_step(step, tl);
    EXPECT_EQ(w.last_path().empty(), step < 3) << step;
  }
  const json doc = read_json(w.last_path());
  EXPECT_EQ(doc.at("otherData").at("last_step"), 2);
  std::vector<std::string> names;
  for (const json& s : parse(doc).spans) names.push_back(s.at("name"));
  EXPECT_EQ(names, (std::vector<std::string>{"step", "step", "checkpoint_write"}));
  EXPECT_FALSE(tl.tracing());
}

// A run resumed at step 4 of a 3-6 window traces from step 4.
TEST(TraceWindow, AResumedRunOpensInsideTheWindow) {
  const std::string dir = fresh_test_dir("trace");
  MetricsConfig mc;
  mc.trace = dir;
  mc.trace_steps.first = 3;
  mc.trace_steps.last = 6;
  auto grid = ProcessGrid::single();
  TraceWindow w(mc, *grid);
  Timeline tl;
  for (int step = 4; step <= 8; ++step) {
    w.before_step(step, tl);
    { SpanScope s(&tl, "step", Track::Main, -1, -1, step); }
    w.after_step(step, tl);
  }
  w.finish(tl);
  EXPECT_EQ(parse(read_json(w.last_path())).spans.size(), 3u);  // steps 4, 5, 6
}

TEST(TraceWindow, NoDirectoryNoWindow) {
  MetricsConfig mc;  // metrics.trace empty
  auto grid = ProcessGrid::single();
  TraceWindow w(mc, *grid);
  Timeline tl;
  w.before_step(mc.trace_steps.first, tl);
  EXPECT_FALSE(w.enabled());
  EXPECT_FALSE(tl.tracing());
}

}  // namespace
}  // namespace xirang
