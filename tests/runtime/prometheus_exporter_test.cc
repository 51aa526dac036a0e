// The Prometheus endpoint: the exposition text (names, HELP and TYPE, base
// units, labels, counters), which rank serves where, and the server.
#include "runtime/observe/prometheus_exporter.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <limits>
#include <sstream>
#include <string>

#include "core/error.h"

namespace xirang {
namespace {

StepMetrics sample_step(int step) {
  StepMetrics m;
  m.step = step;
  m.loss = 3.25;
  m.lr = 6e-4;
  m.grad_norm = 1.5;
  m.tokens_per_s = 2048;
  m.step_ms = 250;
  m.mfu = 0.375;
  m.forward_ms = 80;
  m.backward_ms = 120;
  m.optimizer_ms = 10;
  m.data_wait_ms = 2;
  m.data_prefetch_depth = 3;
  m.dp_comm_ms = 40;
  m.dp_comm_exposed_ms = 5;
  m.tp_comm_ms = 7;
  m.pp_bubble_ms = 12;
  m.pp_comm_exposed_ms = 1;
  m.loss_scale = 1024;
  m.straggler_ratio = 1.5;
  m.slowest_rank = 3;
  m.below_baseline = true;
  return m;
}

// The value of the sample line that starts with `series` ("name{labels}"); fails when absent.
double value_of(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  ADD_FAILURE() << "no sample " << series << " in:\n" << text;
  return -1;
}

bool has_line(const std::string& text, const std::string& line) { return text.find(line + "\n") != std::string::npos; }

const char* kLabels = "{job=\"run7\",rank=\"0\"}";
std::string s(const char* name) { return std::string(name) + kLabels; }

TEST(PrometheusMetrics, GaugesInBaseUnitsWithHelpTypeAndLabels) {
  PrometheusMetrics pm("run7", 0, PrometheusRun{512, 3.0e9});
  pm.update(sample_step(1));
  const std::string t = pm.text();
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_tokens_per_second")), 2048);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_mfu_ratio")), 0.375);
  // Milliseconds in StepMetrics, seconds on the wire.
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_seconds")), 0.25);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_forward_seconds")), 0.08);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_backward_seconds")), 0.12);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_optimizer_seconds")), 0.01);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_data_wait_seconds")), 0.002);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_dp_comm_seconds")), 0.04);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_dp_comm_exposed_seconds")), 0.005);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_tp_comm_seconds")), 0.007);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_pp_bubble_seconds")), 0.012);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_pp_comm_exposed_seconds")), 0.001);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_checkpoint_stall_seconds")), 0);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_loss")), 3.25);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_grad_norm")), 1.5);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_loss_scale")), 1024);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_learning_rate")), 6e-4);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_data_prefetch_depth")), 3);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_straggler_ratio")), 1.5);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_slowest_rank")), 3);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_below_baseline")), 1);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_memory_planned_bytes")), 3.0e9);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step")), 1);
  EXPECT_TRUE(has_line(t, "# TYPE xirang_step_seconds gauge"));
  EXPECT_TRUE(has_line(t, "# HELP xirang_step_seconds Wall time of the last step."));
  EXPECT_TRUE(has_line(t, "# TYPE xirang_steps_total counter"));
  // Every sample's family has a HELP and a TYPE line before it, and carries both labels.
  std::istringstream in(t);
  std::string family;
  int samples = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) == 0) family = line.substr(7, line.find(' ', 7) - 7);
    if (line[0] == '#') continue;
    ++samples;
    const std::string name = line.substr(0, line.find('{'));
    EXPECT_EQ(name, family) << line;
    EXPECT_EQ(name.rfind("xirang_", 0), 0u) << line;
    EXPECT_NE(line.find(kLabels), std::string::npos) << line;
    EXPECT_NE(t.find("# HELP " + name + " "), std::string::npos) << line;
    EXPECT_EQ(name.find("_ms"), std::string::npos) << "milliseconds on the wire: " << line;
  }
  EXPECT_EQ(samples, 28);
}

TEST(PrometheusMetrics, CountersStartAtZeroAndIncrease) {
  PrometheusMetrics pm("run7", 0, PrometheusRun{512, 0});
  std::string t = pm.text();
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_steps_total")), 0);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_tokens_total")), 0);
  // No gauge sample before the first step: a 0 tokens/s would read as a stall.
  EXPECT_EQ(t.find(s("xirang_tokens_per_second")), std::string::npos);
  StepMetrics a = sample_step(1), b = sample_step(2), c = sample_step(3);
  b.skipped = true;
  c.checkpoint_saved = true;
  c.ckpt_stall_ms = 1500;
  c.val_loss = 2.5;
  pm.update(a);
  pm.update(b);
  pm.update(c);
  t = pm.text();
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_steps_total")), 3);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_tokens_total")), 3 * 512);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_skipped_steps_total")), 1);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_checkpoints_total")), 1);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step_checkpoint_stall_seconds")), 1.5);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_validation_loss")), 2.5);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_step")), 3);
}

// A run whose device energy is measured: a joules counter over the steps
// and the last step's watts; a run without (the CPU backend) has neither family.
TEST(PrometheusMetrics, EnergyCounterAndPowerGaugeWhereMeasured) {
  PrometheusMetrics pm("run7", 0, PrometheusRun{512, 0, true});
  std::string t = pm.text();
  EXPECT_TRUE(has_line(t, "# TYPE xirang_energy_joules_total counter"));
  EXPECT_TRUE(has_line(t, "# TYPE xirang_power_watts gauge"));
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_energy_joules_total")), 0);
  EXPECT_EQ(t.find(s("xirang_power_watts")), std::string::npos);  // no gauge sample before a step
  StepMetrics a = sample_step(1), b = sample_step(2), c = sample_step(3);
  a.energy = StepEnergy{150, 150.0 / 512, 600};
  b.energy = StepEnergy{100, 100.0 / 512, 400};
  pm.update(a);
  pm.update(b);
  t = pm.text();
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_energy_joules_total")), 250);
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_power_watts")), 400);
  pm.update(c);  // a step whose reading failed: the counter holds, the gauge has no sample
  t = pm.text();
  EXPECT_DOUBLE_EQ(value_of(t, s("xirang_energy_joules_total")), 250);
  EXPECT_EQ(t.find(s("xirang_power_watts")), std::string::npos);

  PrometheusMetrics cpu("run7", 0, PrometheusRun{512, 0});
  cpu.update(sample_step(1));
  EXPECT_EQ(cpu.text().find("xirang_energy_joules_total"), std::string::npos);
  EXPECT_EQ(cpu.text().find("xirang_power_watts"), std::string::npos);
}

TEST(PrometheusMetrics, EscapesTheJobAndSpellsSpecialValues) {
  PrometheusMetrics pm("a\"b\\c\nd", 5, PrometheusRun{});
  StepMetrics m = sample_step(1);
  m.grad_norm = std::numeric_limits<double>::infinity();
  m.loss = std::numeric_limits<double>::quiet_NaN();
  pm.update(m);
  const std::string t = pm.text();
  EXPECT_TRUE(has_line(t, "xirang_grad_norm{job=\"a\\\"b\\\\c\\nd\",rank=\"5\"} +Inf")) << t;
  EXPECT_TRUE(has_line(t, "xirang_loss{job=\"a\\\"b\\\\c\\nd\",rank=\"5\"} NaN")) << t;
}

TEST(PrometheusEndpoint, RankZeroOrEveryRankAtPortPlusLocalRank) {
  MetricsConfig m;
  EXPECT_FALSE(prometheus_endpoint(m, 0, 0));
  m.prometheus = "127.0.0.1:9400";
  ASSERT_TRUE(prometheus_endpoint(m, 0, 0));
  EXPECT_EQ(prometheus_endpoint(m, 0, 0)->host, "127.0.0.1");
  EXPECT_EQ(prometheus_endpoint(m, 0, 0)->port, 9400);
  EXPECT_FALSE(prometheus_endpoint(m, 1, 1));
  m.prometheus_per_rank = true;
  EXPECT_EQ(prometheus_endpoint(m, 0, 0)->port, 9400);
  EXPECT_EQ(prometheus_endpoint(m, 5, 1)->port, 9401);
  m.prometheus = "[::1]:65535";
  EXPECT_EQ(prometheus_endpoint(m, 0, 0)->host, "::1");
  try {
    prometheus_endpoint(m, 1, 1);
    ADD_FAILURE() << "port 65536 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("metrics.prometheus_per_rank"), std::string::npos) << e.what();
  }
}

TEST(PrometheusExporter, ServesMetricsAndRefusesAPortInUse) {
  PrometheusExporter ex(Endpoint{"127.0.0.1", 0}, "metrics.prometheus", PrometheusMetrics("run7", 0, PrometheusRun{512, 0}));
  ASSERT_GT(ex.port(), 0);
  StepMetrics m = sample_step(1);
  ex.on_step(m);
  httplib::Client cli("127.0.0.1", ex.port());
  auto res = cli.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_DOUBLE_EQ(value_of(res->body, s("xirang_steps_total")), 1);
  EXPECT_EQ(res->body, ex.text());
  try {
    PrometheusExporter second(Endpoint{"127.0.0.1", ex.port()}, "metrics.prometheus", PrometheusMetrics("x", 0, {}));
    ADD_FAILURE() << "a second server bound port " << ex.port();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("metrics.prometheus"), std::string::npos) << msg;
    EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(ex.port())), std::string::npos) << msg;
    EXPECT_NE(msg.find("in use"), std::string::npos) << msg;
  }
}

TEST(PrometheusExporter, StopsAtDestructionRightAfterStarting) {
  int port = 0;
  {
    PrometheusExporter ex(Endpoint{"127.0.0.1", 0}, "metrics.prometheus", PrometheusMetrics("x", 0, {}));
    port = ex.port();
  }
  // Closed: nobody answers, and the port can be bound again.
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(1);
  EXPECT_FALSE(cli.Get("/metrics"));
  PrometheusExporter again(Endpoint{"127.0.0.1", port}, "metrics.prometheus", PrometheusMetrics("x", 0, {}));
  EXPECT_EQ(again.port(), port);
}

}  // namespace
}  // namespace xirang
