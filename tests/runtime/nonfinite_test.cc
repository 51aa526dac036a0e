// The non-finite guard and the loss-spike guard of the single-rank trainer
// (docs/reliability.md).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/device_memory.h"
#include "runtime/checkpoint/checkpoint_convert.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/faults.h"
#include "runtime/resilience/guards.h"
#include "runtime/step/optimizer.h"
#include "runtime/trainer.h"
#include "tests/support/temp_dir.h"
#include "tests/runtime/trainer_fixture.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;
using namespace trainer_testing;

// The non-finite guard (docs/reliability.md). faults.kind=nan_grad writes NaN
// into the first gradient the norm covers, after the reduction: the step
// is skipped and the parameters stay exactly as they were, in every precision.
TEST(NonFinite, PoisonedGradientSkipsTheStepInEveryPrecision) {
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(dtype);
    const std::vector<std::string> o = {std::string("precision.dtype=") + dtype, "train.steps=4",
                                        "faults.kind=nan_grad", "faults.step=2"};
    auto upto = [&](int n) {
      std::vector<std::string> v = o;
      v.push_back("train.stop_after=" + std::to_string(n));
      return v;
    };
    Trainer one(debug_config(upto(1)), quiet()), two(debug_config(upto(2)), quiet());
    one.run();
    const double scale = one.loss_scale().scale();
    TrainResult r2 = two.run();
    ASSERT_EQ(r2.steps.size(), 2u);
    EXPECT_FALSE(r2.steps[0].skipped);
    EXPECT_TRUE(r2.steps[1].skipped);
    EXPECT_FALSE(std::isfinite(r2.steps[1].grad_norm));
    EXPECT_EQ(flat_params(one), flat_params(two)) << "the poisoned step changed the parameters";
    EXPECT_EQ(two.optimizer().updates(), 1);
    // fp16: an overflow like any other, the dynamic scale backs off.
    if (std::string(dtype) == "fp16") {
      EXPECT_EQ(two.loss_scale().scale(), scale / 2);
    }
    Trainer all(debug_config(o), quiet());
    TrainResult r = all.run();
    ASSERT_EQ(r.steps.size(), 4u);
    for (int i : {2, 3}) {
      EXPECT_FALSE(r.steps[size_t(i)].skipped) << "step " << i + 1;
      EXPECT_TRUE(std::isfinite(r.steps[size_t(i)].loss)) << "step " << i + 1;
    }
    EXPECT_NE(flat_params(all), flat_params(two)) << "training did not go on after the skipped step";
  }
}

// The first parameter the optimizer's segments cover: where nan_grad writes.
std::string first_segment_param(Trainer& t) {
  return t.parameters()[size_t(t.optimizer().segments().front().param_index)].name;
}

// Persistent NaN: train.max_nonfinite_steps skips in a row end the run with
// one line naming the step, the first non-finite quantity and where it was.
TEST(NonFinite, PersistentPoisonStopsAtTheLimitNamingTheParameter) {
  Trainer t(debug_config({"train.steps=8", "faults.kind=nan_grad", "faults.step=2", "faults.steps=100",
                          "train.max_nonfinite_steps=2"}),
            quiet());
  try {
    t.run();
    FAIL() << "the run went on past train.max_nonfinite_steps";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Data);
    const std::string want = "training stopped at step 3: 2 steps in a row skipped for non-finite values "
                             "(train.max_nonfinite_steps=2); the first, step 2: non-finite gradient of parameter '" +
                             first_segment_param(t) + "' (on rank 0)";
    EXPECT_EQ(std::string(e.what()), want);
  }
  EXPECT_EQ(t.optimizer().updates(), 1);
}

// fp16: overflow skips count toward the limit only once the dynamic scale
// is at precision.min_scale, where backing off can no longer help.
TEST(NonFinite, Fp16OverflowsCountOnlyAtTheMinimumScale) {
  Trainer t(debug_config({"precision.dtype=fp16", "precision.initial_scale=4", "precision.min_scale=1",
                          "precision.hysteresis=1", "train.steps=10", "faults.kind=nan_grad", "faults.step=2",
                          "faults.steps=100", "train.max_nonfinite_steps=2"}),
            quiet());
  try {
    t.run();
    FAIL() << "the run went on past train.max_nonfinite_steps";
  } catch (const Error& e) {
    // Steps 2 and 3 halve the scale (4 -> 2 -> 1); steps 4 and 5, at the minimum, count.
    EXPECT_NE(std::string(e.what()).find("training stopped at step 5: 2 steps in a row"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("the first, step 4: non-finite gradient"), std::string::npos) << e.what();
  }
  EXPECT_EQ(t.loss_scale().scale(), 1);
}

// A save of non-finite state is refused: the committed checkpoints and
// `latest` stay; checkpoint.on_error=continue warns and trains on.
TEST(NonFinite, NonFiniteWeightsAreNeverCheckpointed) {
  for (const char* on_error : {"stop", "continue"}) {
    SCOPED_TRACE(on_error);
    const std::string dir = testing_util::fresh_test_dir("ckpt_nonfinite");
    const std::vector<std::string> o = {"train.steps=4", "checkpoint.async=false", "checkpoint.every=1",
                                        "checkpoint.dir=" + dir, std::string("checkpoint.on_error=") + on_error};
    std::vector<std::string> first = o;
    first.push_back("train.stop_after=2");
    Trainer(debug_config(first), quiet()).run();
    Trainer t(debug_config(o), quiet());  // resumes at step 2
    Parameter& p = t.parameters().front();
    p.value.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
    bool stopped = false;
    try {
      EXPECT_EQ(t.run().steps.size(), 2u);
    } catch (const Error& e) {
      stopped = true;
      EXPECT_EQ(e.kind(), ErrorKind::Checkpoint);
      EXPECT_NE(std::string(e.what()).find("checkpoint step 3 not saved (rank 0: tensor '" + p.name +
                                           "' (params) holds non-finite values"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("latest stays " + dir + "/step_00000002"), std::string::npos) << e.what();
    }
    EXPECT_EQ(stopped, std::string(on_error) == "stop");
    CheckpointDir d(dir);
    EXPECT_EQ(d.complete_steps(), std::vector<int64_t>({1, 2}));
    EXPECT_EQ(*d.latest(), dir + "/step_00000002");
    EXPECT_FALSE(fs::exists(d.tmp_dir(3)));
    EXPECT_FALSE(fs::exists(d.tmp_dir(4)));
  }
}

// The loss-spike guard against a float64 reading of its rule: the mean and
// (population) standard deviation of the window before each loss.
TEST(LossSpikeGuard, FlagsLossesFarAboveTheRecentWindowAndAbsorbsALastingShift) {
  LossSpikeGuard g(3.0, 8, 4);
  uint64_t state = 12345;
  auto noise = [&] {  // deterministic, in [-0.05, 0.05)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (double(state >> 11) / double(uint64_t(1) << 53) - 0.5) / 10;
  };
  std::deque<double> window;
  auto expect = [&](double loss) {
    bool want = false;
    if (window.size() >= 4) {
      double mean = 0, var = 0;
      for (double l : window) mean += l;
      mean /= double(window.size());
      for (double l : window) var += (l - mean) * (l - mean);
      want = (loss - mean) > 3.0 * std::sqrt(var / double(window.size()));
    }
    window.push_back(loss);
    if (window.size() > 8) window.pop_front();
    return want;
  };
  int spikes = 0;
  for (int i = 0; i < 40; ++i) {
    const double loss = (i == 20 ? 9.0 : i >= 30 ? 7.0 : 5.0) + noise();
    const bool want = expect(loss);
    EXPECT_EQ(g.spike(loss), want) << "loss " << i;
    spikes += want;
    EXPECT_FALSE(i < 4 && want) << "loss " << i << " flagged during the warm-up";
    EXPECT_TRUE(i != 20 || want) << "a jump of 4 with noise 0.05 is a spike";
    EXPECT_FALSE(i >= 36 && want) << "the shift to 7 was not absorbed by loss " << i;
  }
  EXPECT_LE(spikes, 4);
}

// In training: a normal run with the guard on skips nothing and trains bit
// for bit as without it; a guard that flags any loss above the window's mean
// skips those updates, leaving the parameters as they were.
TEST(LossSpikeGuard, SkippedUpdatesLeaveTheParameters) {
  Trainer plain(debug_config({"train.steps=8"}), quiet()),
      guarded(debug_config({"train.steps=8", "train.skip_loss_spikes_zscore=3"}), quiet());
  const TrainResult a = plain.run(), b = guarded.run();
  EXPECT_EQ(a.losses, b.losses);
  for (const StepMetrics& m : b.steps) EXPECT_FALSE(m.skipped) << "step " << m.step;
  // A learning rate too small to lower the loss: the batches' noise decides, so
  // some losses after the 16-step warm-up lie above the mean.
  const std::vector<std::string> o = {"train.steps=30", "train.lr=1e-9", "train.skip_loss_spikes_zscore=1e-6"};
  Trainer t(debug_config(o), quiet());
  const TrainResult r = t.run();
  int first = 0, skipped = 0;
  for (const StepMetrics& m : r.steps) {
    EXPECT_FALSE(m.step <= 16 && m.skipped) << "step " << m.step << " skipped during the warm-up";
    if (m.skipped && !first) first = m.step;
    skipped += m.skipped;
  }
  ASSERT_GT(first, 0) << "no loss above the mean in 14 noisy steps";
  EXPECT_LT(skipped, 14) << "every step skipped";
  EXPECT_EQ(t.optimizer().updates(), 30 - skipped);
  auto upto = [&](int n) {
    std::vector<std::string> v = o;
    v.push_back("train.stop_after=" + std::to_string(n));
    Trainer u(debug_config(v), quiet());
    u.run();
    return flat_params(u);
  };
  EXPECT_EQ(upto(first - 1), upto(first)) << "the update of spike step " << first << " was applied";
}

}  // namespace
}  // namespace xirang
