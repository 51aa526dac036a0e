// A decoder whose feed-forward role is the mixture of experts (llama with
// model.moe.num_experts > 0): its parameters, a float64 finite-difference
// check of the whole chunk with the balance loss on, recomputation giving
// bitwise the gradients of none, and a few training steps in which the
// loss falls, the balance loss is reported apart and the bias moves.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/elementwise.h"
#include "models/layers/moe_ffn.h"
#include "models/llama/llama.h"
#include "tests/kernels/gradcheck.h"
#include "tests/models/model_fixture.h"

namespace xirang {
namespace {

ModelDims moe_dims(int shared, MoeAuxLoss aux) {
  ModelDims d{.arch = "llama", .n_layer = 2, .n_head = 4, .n_kv_head = 2, .d_model = 16, .ffn_hidden = 24,
              .max_seq_len = 6, .vocab_size = 11, .vocab_multiple = 16};
  d.moe.num_experts = 4;
  d.moe.top_k = 2;
  d.moe.expert_hidden = 8;
  d.moe.shared_hidden = shared;
  d.moe.aux_loss = aux;
  d.moe.aux_loss_coeff = 0.05;
  return d;
}

struct TinyMoe {
  ModelDims shape;
  ChunkBatch batch;
  ChunkInArenas<Llama> built;
  Llama& model = built.model;
  std::vector<int32_t> tokens, targets;
  Tensor tok, tgt;
  KernelContext ctx;

  TinyMoe(DType dt, const ModelDims& d, Recompute recompute = Recompute::None)
      : shape(d),
        batch{.micro_batch = 2, .seq_len = 5, .activation_slots = 1, .recompute = recompute},
        built(shape, ChunkPlacement::whole(shape.n_layer), dt, batch) {
    const int64_t n = int64_t(batch.micro_batch) * batch.seq_len;
    for (int64_t i = 0; i < n; ++i) {
      tokens.push_back(int32_t(rng_below(7, 1, uint64_t(i), uint64_t(shape.vocab_size))));
      targets.push_back(int32_t(rng_below(7, 2, uint64_t(i), uint64_t(shape.vocab_size))));
    }
    tok = Tensor(tokens.data(), {batch.micro_batch, batch.seq_len}, DType::I32);
    tgt = Tensor(targets.data(), {batch.micro_batch, batch.seq_len}, DType::I32);
  }
  double dloss() const { return 1.0 / (double(batch.micro_batch) * batch.seq_len); }
  // The training objective: the mean language-model loss plus the balance loss.
  double objective() {
    model.forward(ctx, 0, tok, tgt, dloss());
    return model.take_loss(ctx) + model.take_aux_loss();
  }
  void zero_grads() {
    for (Parameter& p : model.parameters()) std::memset(p.grad.raw(), 0, p.grad.bytes());
  }
};

TEST(MoeDecoder, ParametersOfTheExpertsRouterAndSharedExperts) {
  TinyMoe m(DType::F32, moe_dims(6, MoeAuxLoss::None));
  std::vector<std::string> mlp;
  for (const Parameter& p : m.model.parameters())
    if (p.name.rfind("layers.0.mlp", 0) == 0) mlp.push_back(p.name + " " + p.value.shape().str());
  EXPECT_EQ(mlp, (std::vector<std::string>{"layers.0.mlp.gate.weight (4, 16)",
                                           "layers.0.mlp.experts.gate_up_proj.weight (4, 16, 16)",
                                           "layers.0.mlp.experts.down_proj.weight (4, 8, 16)",
                                           "layers.0.mlp.shared_expert.gate_up_proj.weight (12, 16)",
                                           "layers.0.mlp.shared_expert.down_proj.weight (16, 6)"}));
  // The dense llama of the same dims is untouched by the moe keys it does not set.
  ModelDims dense = moe_dims(0, MoeAuxLoss::None);
  dense.moe = {};
  EXPECT_EQ(llama_spec(dense).ffn, FfnKind::SwiGlu);
  EXPECT_EQ(llama_spec(m.shape).ffn, FfnKind::Moe);
}

TEST(MoeDecoder, EveryParameterMatchesFiniteDifferencesWithTheBalanceLoss) {
  TinyMoe m(DType::F64, moe_dims(6, MoeAuxLoss::Sequence));
  randomize_parameters(m.model, 31);
  m.objective();
  m.model.backward(m.ctx, 0, m.tok);
  const double h = 1e-6;
  for (Parameter& p : m.model.parameters()) {
    double* v = p.value.data<double>();
    const double* g = p.grad.data<double>();
    const bool table = p.name == "embed_tokens.weight" || p.name == "lm_head.weight";
    const int64_t limit = table ? int64_t(m.shape.vocab_size) * m.shape.d_model : p.value.numel();
    std::vector<double> fd, an;
    for (int64_t k = 0; k < std::min<int64_t>(12, limit); ++k) {
      const int64_t i = int64_t(rng_below(5, name_stream(p.name), uint64_t(k), uint64_t(limit)));
      fd.push_back(test::central_difference(v[i], h, [&] { return m.objective(); }));
      an.push_back(g[i]);
    }
    EXPECT_LT(test::normwise_error(fd, an), 1e-6) << p.name;
  }
}

TEST(MoeDecoder, RecomputationGivesBitwiseTheGradientsOfNone) {
  std::vector<std::vector<float>> grads;
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    TinyMoe m(DType::F32, moe_dims(6, MoeAuxLoss::Global), r);
    m.model.init_parameters(7);
    m.zero_grads();
    m.objective();
    m.model.backward(m.ctx, 0, m.tok);
    std::vector<float> g;
    for (const Parameter& p : m.model.parameters())
      g.insert(g.end(), p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
    grads.push_back(g);
  }
  EXPECT_TRUE(grads[0] == grads[1]) << "selective";
  EXPECT_TRUE(grads[0] == grads[2]) << "full";
}

// With bf16 storage the router widens its input and weight to f32 (its
// gradient is f32 as every gradient under a 16-bit dtype): the loss and
// the router's gradient track the f32 model's.
TEST(MoeDecoder, Bf16StorageRoutesInF32AndTracksF32) {
  TinyMoe lo(DType::BF16, moe_dims(6, MoeAuxLoss::Global)), hi(DType::F32, moe_dims(6, MoeAuxLoss::Global));
  for (TinyMoe* m : {&lo, &hi}) {
    m->model.init_parameters(9);
    for (Parameter& p : m->model.parameters())  // a router with a say: larger than the 0.02 init
      if (p.name == "layers.0.mlp.gate.weight") {
        std::vector<float> v(size_t(p.value.numel()));
        for (size_t i = 0; i < v.size(); ++i) v[i] = float(0.5 * rng_normal(3, 4, i));
        cast(KernelContext{}, p.value, Tensor(v.data(), p.value.shape(), DType::F32));
      }
    m->zero_grads();
  }
  const double l_lo = lo.objective(), l_hi = hi.objective();
  EXPECT_NEAR(l_lo, l_hi, 2e-2 * l_hi);
  lo.model.backward(lo.ctx, 0, lo.tok);
  hi.model.backward(hi.ctx, 0, hi.tok);
  auto router_grad = [](TinyMoe& m) {
    for (Parameter& p : m.model.parameters())
      if (p.name == "layers.0.mlp.gate.weight") {
        EXPECT_EQ(p.grad.dtype(), DType::F32);
        return std::vector<double>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
      }
    return std::vector<double>{};
  };
  EXPECT_LT(test::normwise_error(router_grad(lo), router_grad(hi)), 0.1);
}

TEST(MoeDecoder, TrainsAFewStepsAndTheBiasMoves) {
  ModelDims d = moe_dims(0, MoeAuxLoss::Global);
  d.moe.bias_update_rate = 0.01;
  TinyMoe m(DType::F32, d);
  m.model.init_parameters(3);
  std::vector<double> losses;
  for (int step = 0; step < 20; ++step) {
    m.zero_grads();
    m.model.forward(m.ctx, 0, m.tok, m.tgt, m.dloss());
    losses.push_back(m.model.take_loss(m.ctx));
    const double aux = m.model.take_aux_loss();
    EXPECT_GT(aux, 0.0) << "step " << step;
    EXPECT_EQ(m.model.take_aux_loss(), 0.0);
    m.model.backward(m.ctx, 0, m.tok);
    for (Parameter& p : m.model.parameters())  // plain SGD
      for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] -= 0.5f * p.grad.data<float>()[i];
    m.model.end_step(m.ctx);
  }
  EXPECT_LT(losses.back(), 0.8 * losses.front()) << losses.front() << " -> " << losses.back();
  const auto& ffn = static_cast<const MoeFeedForward&>(*m.model.layers().blocks[0].ffn);
  double moved = 0;
  for (double b : ffn.bias()) moved += std::abs(b);
  EXPECT_GT(moved, 0.0);
  int64_t tokens = 0;
  for (int64_t c : ffn.last_loads()) tokens += c;
  EXPECT_EQ(tokens, 2 * 5 * 2);  // one microbatch's N k choices
}

}  // namespace
}  // namespace xirang
