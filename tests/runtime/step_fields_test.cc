// The table of the step's times (runtime/observe/step_fields.h): one row per part
// of the step clock, keys that say their part and unit, every row written
// to metrics.jsonl and documented in docs/metrics.md.
#include "runtime/observe/step_fields.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "runtime/observe/metrics.h"
#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

TEST(StepFields, OneRowPerPartOfTheClockAndKeysThatSayIt) {
  std::set<std::string> keys;
  int totals = 0, rests = 0;
  for (const StepField& f : step_fields()) {
    SCOPED_TRACE(f.key);
    EXPECT_TRUE(keys.insert(f.key).second) << "twice";
    EXPECT_EQ(std::string(f.unit), "ms");
    EXPECT_TRUE(std::string(f.key).ends_with("_ms"));
    EXPECT_FALSE(std::string(f.help).empty());
    EXPECT_EQ(f.kind == StepField::Kind::Part, f.part.has_value());
    if (f.part) EXPECT_EQ(std::string(f.key), std::string(step_part_name(*f.part)) + "_ms");
    if (f.gauge) EXPECT_TRUE(std::string(f.gauge).ends_with("_seconds"));
    EXPECT_EQ(find_step_field(f.key), &f);
    totals += f.kind == StepField::Kind::Total;
    rests += f.kind == StepField::Kind::Unaccounted;
  }
  EXPECT_EQ(totals, 1);
  EXPECT_EQ(rests, 1);
  EXPECT_EQ(find_step_field("nothing_ms"), nullptr);
  // Every part a step's time is charged to has its row; the host's wait for
  // the device is no field's (its time is the device's, in the passes).
  for (size_t p = 0; p < kStepParts; ++p) {
    if (StepPart(p) == StepPart::DeviceWait) continue;
    EXPECT_EQ(step_field(StepPart(p)).part, StepPart(p)) << step_part_name(StepPart(p));
  }
}

// metrics.jsonl carries every row with the step's value.
TEST(StepFields, TheJsonlWriterWritesEveryRow) {
  const std::string path = testing_util::fresh_test_dir() + "/m.jsonl";
  StepMetrics m;
  m.step = 3;
  double v = 1.25;
  for (const StepField& f : step_fields()) m.*f.value = (v += 1);
  {
    MetricsLog log(path, PeakFlops{1e12, "test"}, JsonlFields{});
    log.write(m);
  }
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(line);
  for (const StepField& f : step_fields()) {
    ASSERT_TRUE(j.contains(f.key)) << f.key;
    EXPECT_EQ(j[f.key].get<double>(), m.*f.value) << f.key;
  }
  // The order the file has always had (cp_comm_ms joined after tp_comm_ms).
  std::string keys;
  for (const auto& [k, v] : j.items()) keys += k + " ";
  EXPECT_EQ(keys.substr(0, keys.find("loss_scale")),
            "step loss lr grad_norm tokens_per_s step_ms mfu forward_ms backward_ms optimizer_ms data_wait_ms "
            "data_prefetch_depth dp_comm_ms dp_comm_exposed_ms tp_comm_ms cp_comm_ms pp_bubble_ms pp_comm_exposed_ms "
            "ckpt_stall_ms unaccounted_ms ");
}

// docs/metrics.md has a row for each field: its key and its unit.
TEST(StepFields, EveryRowIsDocumented) {
  std::ifstream in(std::string(XIRANG_SOURCE_DIR) + "/docs/metrics.md");
  ASSERT_TRUE(in);
  std::stringstream text;
  text << in.rdbuf();
  for (const StepField& f : step_fields())
    EXPECT_NE(text.str().find(std::string("| `") + f.key + "` | " + f.unit + " |"), std::string::npos)
        << f.key << " has no row in docs/metrics.md";
}

}  // namespace
}  // namespace xirang
