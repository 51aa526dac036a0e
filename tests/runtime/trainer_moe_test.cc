// The trainer on configs/moe_debug.yaml (a llama whose feed-forward is a
// mixture of experts), one CPU rank: the loss falls, and after each
// optimizer step the selection bias has moved from that step's loads
// (ModelChunk::end_step).
#include <gtest/gtest.h>

#include <cmath>

#include "models/decoder/decoder_chunk.h"
#include "models/layers/moe_ffn.h"
#include "tests/runtime/trainer_fixture.h"

namespace xirang {
namespace {

using namespace trainer_testing;

TEST(TrainerMoe, TheDebugMixtureOfExpertsTrainsAndItsBiasMoves) {
  Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/moe_debug.yaml",
                         {"data.train=" + english_dataset(), "train.steps=8", "model.n_layer=2"});
  validate(c, 1);
  Trainer t(c, quiet());
  TrainResult r = t.run();
  ASSERT_EQ(r.losses.size(), 8u);
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(r.losses.back(), r.losses.front() - 0.3) << "the MoE debug model did not learn";
  const auto& chunk = dynamic_cast<const DecoderChunk&>(t.model());
  for (const DecoderLayers::Block& b : chunk.layers().blocks) {
    const auto& ffn = dynamic_cast<const MoeFeedForward&>(*b.ffn);
    int64_t choices = 0;
    for (int64_t n : ffn.last_loads()) choices += n;
    EXPECT_EQ(choices, int64_t(c.train.global_batch) * c.model.max_seq_len * c.model.moe.top_k);
    double moved = 0;
    for (double v : ffn.bias()) moved += std::abs(v);
    EXPECT_GT(moved, 0.0);
    EXPECT_GE(ffn.last_imbalance(), 1.0);
  }
}

}  // namespace
}  // namespace xirang
