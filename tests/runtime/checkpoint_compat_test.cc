// Checkpoints written by earlier versions still resume. The asset
// tests/assets/checkpoints/gpt2_tiny_tp2 is a checkpoint of a tiny GPT-2
// saved at step 3 on two ranks (tp=2) by the trainer as it was before the
// model interface (models/model.h) existed, with the losses that trainer
// made when it resumed it on one rank for steps 4 to 6. Resuming it now
// must give those losses bit for bit: the parameter names, shards, init
// rules, optimizer state and data order all survived the redesign.
// Those losses came from OpenBLAS's products, so the test pins that GEMM
// path (oneDNN's blocks sum in another order: other last bits).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/matmul.h"
#include "runtime/config/config.h"
#include "runtime/trainer.h"

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
    out.push_back({step, std::stod(loss)});  // written with 17 significant digits: exact
  }
  return out;
}

TEST(CheckpointCompat, PreInterfaceCheckpointResumesWithTheSameLosses) {
  Config c = load_config(kAsset + "/config.yaml",
                         {"data.train=" + kAsset + "/train", "checkpoint.resume=" + kAsset + "/step_00000003"});
  validate(c, 1);
  TrainerOptions quiet;
  quiet.print = false;
  quiet.peak = PeakFlops{1e11, "test"};
  const std::string path_before = cpu_gemm_path();
  set_cpu_gemm_path("openblas");
  Trainer t(c, quiet);
  EXPECT_EQ(t.start_step(), 3);
  const TrainResult r = t.run();
  set_cpu_gemm_path(path_before.substr(0, path_before.find(' ')));
  const auto want = expected_losses();
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(r.losses.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(r.steps[i].step, want[i].first);
    EXPECT_EQ(r.losses[i], want[i].second) << "step " << want[i].first;
  }
}

}  // namespace
}  // namespace xirang
