// model.moe.*: parsed into ModelDims::moe, and each bad value refused with
// one line naming the key, the value and the rule (the decoder's
// moe_key_rules, checked by config validation; spellings by the schema).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "tests/runtime/config_errors.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

class ConfigMoe : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / ("xirang_config_moe_" + std::to_string(getpid()) + "_" +
                                              ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(root_ / "train");
    std::ofstream(root_ / "train" / "index.json") << "{}";
  }
  void TearDown() override { fs::remove_all(root_); }

  Config base(std::vector<std::string> overrides) const {
    std::vector<std::string> all = {"data.train=" + (root_ / "train").string()};
    all.insert(all.end(), overrides.begin(), overrides.end());
    return parse_config(
        "model: {arch: llama, n_layer: 2, n_head: 4, d_model: 64, seq_len: 64, vocab_size: 256,\n"
        "        moe: {num_experts: 8, top_k: 2, expert_hidden: 32}}\n"
        "train: {steps: 10, global_batch: 8, micro_batch: 1}\n",
        all, "moe.yaml");
  }
  void expect_invalid(std::vector<std::string> overrides, const std::vector<std::string>& needles, int world = 1) {
    SCOPED_TRACE(::testing::PrintToString(overrides));
    Config c = base(overrides);
    expect_config_error([&] { validate(c, world); }, needles);
  }

  fs::path root_;
};

TEST_F(ConfigMoe, KeysReachTheModelDims) {
  Config c = base({"model.moe.score=sigmoid", "model.moe.aux_loss=seq", "model.moe.aux_loss_coeff=0.001",
                   "model.moe.shared_hidden=16", "model.moe.bias_update_rate=0.01", "model.moe.normalize=false",
                   "model.moe.force_balance=true"});
  validate(c, 1);
  const MoeDims& m = c.model.moe;
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.top_k, 2);
  EXPECT_EQ(m.expert_hidden, 32);
  EXPECT_EQ(m.shared_hidden, 16);
  EXPECT_EQ(m.score, RouterScore::Sigmoid);
  EXPECT_EQ(m.aux_loss, MoeAuxLoss::Sequence);
  EXPECT_EQ(m.aux_loss_coeff, 0.001);
  EXPECT_EQ(m.bias_update_rate, 0.01);
  EXPECT_FALSE(m.normalize);
  EXPECT_TRUE(m.force_balance);
}

TEST_F(ConfigMoe, TheShippedDebugConfigValidates) {
  Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/moe_debug.yaml",
                         {"data.train=" + (root_ / "train").string()});
  validate(c, 1);
  EXPECT_EQ(c.model.moe.num_experts, 8);
  EXPECT_EQ(c.model.moe.score, RouterScore::Sigmoid);
  EXPECT_EQ(c.model.moe.aux_loss, MoeAuxLoss::Sequence);
}

TEST_F(ConfigMoe, EachBadValueIsOneLine) {
  expect_invalid({"model.moe.num_experts=-1"}, {"model.moe.num_experts", "-1"});
  expect_invalid({"model.moe.top_k=0"}, {"model.moe.top_k", "0"});
  expect_invalid({"model.moe.top_k=9"}, {"model.moe.top_k=9", "model.moe.num_experts=8"});
  expect_invalid({"model.moe.expert_hidden=-4"}, {"model.moe.expert_hidden", "-4"});
  expect_invalid({"model.moe.shared_hidden=-1"}, {"model.moe.shared_hidden", "-1"});
  expect_invalid({"model.moe.bias_update_rate=-0.1"}, {"model.moe.bias_update_rate", "-0.1"});
  expect_invalid({"model.moe.aux_loss_coeff=-1"}, {"model.moe.aux_loss_coeff", "-1"});
  expect_invalid({"model.arch=gpt2"}, {"model.moe.num_experts=8", "gpt2", "no mixture-of-experts"});
  expect_invalid({"parallel.tp=2"}, {"model.moe.num_experts=8", "parallel.tp=2"}, 2);
}

TEST_F(ConfigMoe, BadSpellingsAreOneLine) {
  expect_config_error([&] { base({"model.moe.score=relu"}); }, {"model.moe.score", "relu", "softmax, sigmoid"});
  expect_config_error([&] { base({"model.moe.aux_loss=local"}); }, {"model.moe.aux_loss", "local", "none, seq, global"});
}

}  // namespace
}  // namespace xirang
