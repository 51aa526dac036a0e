// Checkpoints written by earlier versions still resume. The asset
// tests/assets/checkpoints/gpt2_tiny_tp2 is a checkpoint of a tiny GPT-2
// saved at step 3 on two ranks (tp=2) by the trainer as it was before the
// model interface (models/model.h) existed, with the losses that trainer
// made when it resumed it on one rank for steps 4 to 6. Resuming it now
// must give those losses: the parameter names, shards, init rules,
// optimizer state and data order all survived the redesign.
//
// Those losses were computed on another machine, whose BLAS kernels round
// differently, so they are compared within tests/runtime/golden_losses.h's
// tolerance (a wrong name, shard or optimizer moment is off by far more).
// Bitwise equality is checked where it holds: on this machine, the run
// resumed from the asset against the same run stopped after step 4, saved,
// and resumed again.
#include <gtest/gtest.h>

#include <fstream>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/trainer.h"
#include "tests/runtime/golden_losses.h"
#include "tests/support/temp_dir.h"
#include "tests/runtime/trainer_fixture.h"

namespace xirang {
namespace {

const std::string kAsset = std::string(XIRANG_SOURCE_DIR) + "/tests/assets/checkpoints/gpt2_tiny_tp2";

// (step, loss) pairs of resumed_losses.txt; '#' starts a comment line.
std::vector<std::pair<int, double>> expected_losses() {
  std::ifstream f(kAsset + "/resumed_losses.txt");
  EXPECT_TRUE(f.good()) << "missing " << kAsset << "/resumed_losses.txt";
  std::vector<std::pair<int, double>> out;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    int step = 0;
    std::string loss;
    in >> step >> loss;
    out.push_back({step, std::stod(loss)});
  }
  return out;
}

Config asset_config(std::vector<std::string> overrides) {
  overrides.insert(overrides.begin(), {"data.train=" + kAsset + "/train", "checkpoint.async=false"});
  Config c = load_config(kAsset + "/config.yaml", overrides);
  validate(c, 1);
  return c;
}

TrainerOptions quiet() {
  TrainerOptions o;
  o.print = false;
  o.peak = PeakFlops{1e11, "test"};
  return o;
}

TEST(CheckpointCompat, PreInterfaceCheckpointResumesWithTheSameLosses) {
  const std::string resume = "checkpoint.resume=" + kAsset + "/step_00000003";
  Trainer t(asset_config({resume}), quiet());
  EXPECT_EQ(t.start_step(), 3);
  const TrainResult r = t.run();
  const auto want = expected_losses();
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(r.losses.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(r.steps[i].step, want[i].first);
    golden::expect_near_golden(r.losses[i], want[i].second, int(i) + 1, "step " + std::to_string(want[i].first));
  }

  // On this machine, bitwise: resumed from the asset, stopped after step 4
  // with a checkpoint, resumed from that, steps 5 and 6 and the final
  // parameters are those of the uninterrupted t.
  const std::string dir = testing_util::fresh_test_dir("ckpt");
  Trainer a(asset_config({resume, "checkpoint.dir=" + dir, "train.stop_after=4"}), quiet());
  const TrainResult ra = a.run();
  ASSERT_EQ(ra.losses.size(), 1u);
  EXPECT_EQ(ra.losses[0], r.losses[0]) << "step 4: " << std::setprecision(17) << ra.losses[0] << " vs " << r.losses[0];
  Trainer b(asset_config({"checkpoint.resume=" + dir + "/step_00000004"}), quiet());
  EXPECT_EQ(b.start_step(), 4);
  const TrainResult rb = b.run();
  ASSERT_EQ(rb.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_EQ(rb.losses[i], r.losses[1 + i])
        << "step " << 5 + i << ": " << std::setprecision(17) << rb.losses[i] << " resumed, " << r.losses[1 + i] << " not";
  EXPECT_EQ(trainer_testing::flat_params(b), trainer_testing::flat_params(t)) << "the parameters after step 6";
}

}  // namespace
}  // namespace xirang
