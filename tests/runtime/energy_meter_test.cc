// The energy meter against a fake NVML (fake_nvml.cc): joules and watts
// from the energy counter, the power-sampling fallback where the counter is
// not supported, and the reasons it gives when it cannot measure.
#include "runtime/observe/energy_meter.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/clock.h"
#include "tests/runtime/fake_nvml.h"
#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

const char* kFake = XIRANG_FAKE_NVML;  // the fake library's path (tests/CMakeLists.txt)

// The fake's state, reset; the library stays open for the test's lifetime.
class EnergyMeterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = dlopen(kFake, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(lib_, nullptr) << dlerror();
    auto get = reinterpret_cast<FakeNvmlState* (*)()>(dlsym(lib_, "fake_nvml_state"));
    ASSERT_NE(get, nullptr);
    fake_ = get();
    *fake_ = FakeNvmlState{};
  }
  void TearDown() override {
    if (lib_) dlclose(lib_);
  }
  void* lib_ = nullptr;
  FakeNvmlState* fake_ = nullptr;
};

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST_F(EnergyMeterTest, CounterGivesJoulesPerTokenAndWatts) {
  fake_->energy_mj = 123456789;  // energy since the driver loaded: not the run's
  fake_->mj_per_read = 1500;
  {
    EnergyMeter meter(kFake, "00000000:3B:00.0");
    ASSERT_TRUE(meter.measuring()) << meter.reason();
    EXPECT_EQ(meter.source(), EnergySource::Counter);
    EXPECT_STREQ(fake_->bus_id, "00000000:3B:00.0");
    // Every read advances the counter by 1.5 J: the meter counts from its start.
    EXPECT_DOUBLE_EQ(*meter.joules(), 1.5);
    EXPECT_DOUBLE_EQ(*meter.joules(), 3.0);
    Stopwatch sw;
    EnergySpan step(&meter);
    sleep_ms(50);
    const std::optional<StepEnergy> e = step.take(100);
    const double seconds = sw.seconds();
    ASSERT_TRUE(e);
    EXPECT_DOUBLE_EQ(e->joules, 1.5);  // two reads apart
    EXPECT_DOUBLE_EQ(e->joules_per_token, 0.015);
    EXPECT_LE(e->avg_watts, 1.5 / 0.05);  // at least 50 ms passed
    EXPECT_NEAR(e->avg_watts, 1.5 / seconds, 0.01 * e->avg_watts);
    EXPECT_EQ(fake_->power_reads, 0);  // no sampler beside a counter
  }
  EXPECT_EQ(fake_->inits, 1);
  EXPECT_EQ(fake_->shutdowns, 1);
}

TEST_F(EnergyMeterTest, SamplesPowerWhereTheCounterIsNotSupported) {
  fake_->energy_result = 3;  // NVML_ERROR_NOT_SUPPORTED
  __atomic_store_n(&fake_->power_mw, 100000u, __ATOMIC_RELAXED);
  EnergyMeter meter(kFake, "", EnergyMeter::Options{.sample_period_s = 0.002});
  ASSERT_TRUE(meter.measuring()) << meter.reason();
  EXPECT_EQ(meter.source(), EnergySource::PowerSamples);
  Stopwatch sw;
  EnergySpan step(&meter);
  sleep_ms(100);
  const double t1 = sw.seconds();
  // The power changes while the meter runs: only sampling sees it.
  __atomic_store_n(&fake_->power_mw, 300000u, __ATOMIC_RELAXED);
  sleep_ms(100);
  const std::optional<StepEnergy> e = step.take(1000);
  const double t2 = sw.seconds() - t1;
  ASSERT_TRUE(e);
  const double expected = 100 * t1 + 300 * t2;  // W x s
  // The trapezoid between the readings around the change misplaces up to
  // 100 W over one gap between readings; on a loaded machine the sampler
  // runs late, and the gaps it actually had bound the error (ignoring the
  // change, 20 J of 40, stays outside it unless a gap exceeds 0.1 s).
  double gap = 0;
  __atomic_load(&fake_->max_power_read_gap_s, &gap, __ATOMIC_RELAXED);
  const double tol = 0.02 * expected + 200 * gap;
  EXPECT_NEAR(e->joules, expected, tol) << "longest gap between readings " << gap << " s";
  EXPECT_NEAR(e->joules_per_token, e->joules / 1000, 1e-12);
  EXPECT_NEAR(e->avg_watts, expected / (t1 + t2), tol / (t1 + t2));
  EXPECT_GT(__atomic_load_n(&fake_->power_reads, __ATOMIC_RELAXED), 10);
}

TEST_F(EnergyMeterTest, MissingLibraryGivesTheReason) {
  EnergyMeter meter("/nonexistent/libnvidia-ml.so.1", "0000:3B:00.0");
  EXPECT_FALSE(meter.measuring());
  EXPECT_EQ(meter.source(), EnergySource::None);
  EXPECT_EQ(meter.reason().rfind("cannot load /nonexistent/libnvidia-ml.so.1: ", 0), 0u) << meter.reason();
  EXPECT_FALSE(meter.joules());
  EXPECT_FALSE(EnergySpan(&meter).take(100));
  EXPECT_FALSE(EnergySpan(nullptr).take(100));  // the CPU backend: no meter
}

TEST_F(EnergyMeterTest, FailedInitGivesNvmlsMessage) {
  fake_->init_result = 9;
  {
    EnergyMeter meter(kFake, "0000:3B:00.0");
    EXPECT_FALSE(meter.measuring());
    EXPECT_EQ(meter.reason(), "nvmlInit_v2 failed: Driver Not Loaded (NVML error 9)");
  }
  EXPECT_EQ(fake_->shutdowns, 0);  // nothing to shut down
}

TEST_F(EnergyMeterTest, NeitherCounterNorPowerNamesBoth) {
  fake_->energy_result = 3;
  fake_->power_result = 3;
  {
    EnergyMeter meter(kFake, "0000:3B:00.0");
    EXPECT_FALSE(meter.measuring());
    EXPECT_EQ(meter.reason(),
              "nvmlDeviceGetTotalEnergyConsumption failed: Not Supported (NVML error 3); "
              "nvmlDeviceGetPowerUsage failed: Not Supported (NVML error 3)");
  }
  EXPECT_EQ(fake_->shutdowns, 1);  // initialised, then shut down at once
}

// metrics.jsonl: the energy fields on a step that has a reading, none on one
// without (the CPU backend); the backend on every line.
TEST(MetricsLogEnergy, FieldsOnlyWithAReading) {
  const std::string path = testing_util::fresh_test_dir("energy") + "/metrics.jsonl";
  {
    MetricsLog log(path, PeakFlops{1e12, "x"});
    log.set_backend("cuda");
    log.set_energy_source(energy_source_name(EnergySource::Counter));
    StepMetrics m;
    m.step = 1;
    m.energy = StepEnergy{150, 0.25, 600};
    log.write(m);
    m.step = 2;
    m.energy.reset();
    log.write(m);
  }
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const nlohmann::json a = nlohmann::json::parse(line);
  EXPECT_EQ(a.at("backend"), "cuda");
  EXPECT_DOUBLE_EQ(a.at("energy_j").get<double>(), 150);
  EXPECT_DOUBLE_EQ(a.at("joules_per_token").get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(a.at("avg_watts").get<double>(), 600);
  EXPECT_EQ(a.at("energy_source"), "nvml energy counter");
  ASSERT_TRUE(std::getline(in, line));
  const nlohmann::json b = nlohmann::json::parse(line);
  for (const char* key : {"energy_j", "joules_per_token", "avg_watts", "energy_source"})
    EXPECT_FALSE(b.contains(key)) << key;
}

}  // namespace
}  // namespace xirang
