// The mixture-of-experts feed-forward (models/layers/moe_ffn.h) on one
// rank: its forward against a dense per-token loop, bitwise in fp32;
// finite-difference checks in float64 of the router, expert and shared
// weights and the input, with the balance loss off, per sequence and
// global; forced balance; the selection bias (it chooses, the gates keep
// the raw scores; its update rule; bringing a skewed router to balance).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "kernels/moe.h"
#include "kernels/swiglu.h"
#include "models/layers/moe_ffn.h"
#include "tests/kernels/gradcheck.h"

namespace xirang {
namespace {

// One MoE layer with its parameters, activations and state in arenas of its own.
struct Layer {
  static constexpr int64_t C = 6, F = 4;
  int64_t B, T, N;
  MoeDims moe;
  DType dt;
  MoeFeedForward ffn;
  std::vector<Parameter> params;
  Arena store, acts;
  TpComm tp;
  FfnActs a;
  Tensor x, skip, out, dy, scratch;
  KernelContext ctx;

  Layer(const MoeDims& m, DType dtype, int64_t batch = 2, int64_t seq = 5)
      : B(batch), T(seq), N(batch * seq), moe(m), dt(dtype), ffn(m), tp(TensorParallel{}, batch * seq) {
    ParamList list(1, 0, dt, dt);
    ffn.declare(list, "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj", C, F, 0,
                InitRule::normal(0.5), InitRule::normal(0.5), false);
    params = list.take();
    store = Arena("params", 1 << 20);
    for (Parameter& p : params) {
      p.value = store.alloc(p.value.shape(), dt, p.name);
      p.grad = store.alloc(p.grad.shape(), dt, p.name + " grad");
    }
    ffn.bind(params);
    acts = Arena("acts", 1 << 22);
    ActList list_acts;
    ffn.activations(list_acts, a, N, 1, dt);
    for (const ActSpec& s : list_acts) *s.tensor = acts.alloc(s.shape, s.dtype ? *s.dtype : dt, s.what);
    ffn.layout_state(acts, N, T, dt);
    tp.layout(acts, C, dt);
    scratch = acts.alloc({N, ffn.scratch_width(1)}, dt, "scratch");
    x = acts.alloc({N, C}, dt, "x");
    skip = acts.alloc({N, C}, dt, "skip");
    out = acts.alloc({N, C}, dt, "out");
    dy = acts.alloc({N, C}, dt, "dy");
    for (const Parameter& p : params) fill(p.value, name_stream(p.name), 0.7);
    fill(x, 11, 1.0);
    fill(skip, 12, 1.0);
    fill(dy, 13, 1.0);
  }

  void fill(const Tensor& t, uint64_t stream, double scale) {
    for (int64_t i = 0; i < t.numel(); ++i) set(t, i, scale * rng_normal(5, stream, uint64_t(i)));
  }
  static void set(const Tensor& t, int64_t i, double v) {
    if (t.dtype() == DType::F64) t.data<double>()[i] = v;
    else t.data<float>()[i] = float(v);
  }
  static double get(const Tensor& t, int64_t i) {
    return t.dtype() == DType::F64 ? t.data<double>()[i] : double(t.data<float>()[i]);
  }
  Parameter& param(const std::string& name) {
    for (Parameter& p : params)
      if (p.name == name) return p;
    ADD_FAILURE() << "no parameter " << name;
    return params[0];
  }

  // A training forward (dloss 1/N: the balance loss enters the objective
  // with weight 1); returns L = sum(out * dy) + the balance loss.
  double loss() {
    ffn.begin_forward(1.0 / double(N));
    tp.begin_pass(ctx);
    ffn.forward(ctx, tp, out, a, x, skip);
    double L = ffn.take_aux_loss();
    for (int64_t i = 0; i < out.numel(); ++i) L += get(out, i) * get(dy, i);
    return L;
  }
  void backward() {
    for (Parameter& p : params) std::memset(p.grad.raw(), 0, p.grad.bytes());
    ffn.backward(ctx, tp, scratch, dy, a, x, nullptr);
  }
};

MoeDims options(RouterScore score, MoeAuxLoss aux, int shared) {
  MoeDims m;
  m.num_experts = 4;
  m.top_k = 2;
  m.shared_hidden = shared;
  m.score = score;
  m.aux_loss = aux;
  m.aux_loss_coeff = 0.3;  // large enough that a wrong gradient shows
  return m;
}

// Routing as the layer should do it, then each expert run densely over all
// tokens, then per token its k choices in order: acc = fma(gate, y_e, acc),
// and out = (skip + shared(x)) + acc.
std::vector<float> dense_reference(Layer& l) {
  const int64_t N = l.N, C = Layer::C, F = Layer::F, E = l.moe.num_experts, k = l.moe.top_k;
  KernelContext ctx;
  std::vector<float> logits(N * E), scores(N * E), gates(N * k), bias(l.ffn.bias().begin(), l.ffn.bias().end());
  std::vector<int32_t> ids(N * k);
  const Tensor x = l.x;
  linear_forward(ctx, Tensor(logits.data(), {N, E}, DType::F32), x,
                 l.param("layers.0.mlp.gate.weight").value, Tensor());
  router_forward(ctx, Tensor(ids.data(), {N, k}, DType::I32), Tensor(gates.data(), {N, k}, DType::F32),
                 Tensor(scores.data(), {N, E}, DType::F32), Tensor(), Tensor(logits.data(), {N, E}, DType::F32),
                 Tensor(bias.data(), {E}, DType::F32),
                 {.score = l.moe.score, .top_k = k, .normalize = l.moe.normalize, .force_balance = l.moe.force_balance});
  // y_e (N, C) for every expert, all tokens through it.
  std::vector<float> gu(N * 2 * F), h(N * F), ye(E * N * C);
  std::vector<int32_t> all = {0, int32_t(N)};
  const Tensor wgu = l.param("layers.0.mlp.experts.gate_up_proj.weight").value;
  const Tensor wd = l.param("layers.0.mlp.experts.down_proj.weight").value;
  for (int64_t e = 0; e < E; ++e) {
    grouped_matmul_forward(ctx, Tensor(gu.data(), {N, 2 * F}, DType::F32), x,
                           wgu.flat_range(e * C * 2 * F, (e + 1) * C * 2 * F).view({1, C, 2 * F}),
                           Tensor(all.data(), {2}, DType::I32));
    swiglu_packed_forward(ctx, Tensor(h.data(), {N, F}, DType::F32), Tensor(gu.data(), {N, 2 * F}, DType::F32));
    grouped_matmul_forward(ctx, Tensor(ye.data() + e * N * C, {N, C}, DType::F32),
                           Tensor(h.data(), {N, F}, DType::F32),
                           wd.flat_range(e * F * C, (e + 1) * F * C).view({1, F, C}), Tensor(all.data(), {2}, DType::I32));
  }
  std::vector<float> base(N * C);
  if (l.moe.shared_hidden > 0) {
    const int64_t S = l.moe.shared_hidden;
    std::vector<float> sgu(N * 2 * S), sh(N * S);
    linear_forward(ctx, Tensor(sgu.data(), {N, 2 * S}, DType::F32), x,
                   l.param("layers.0.mlp.shared_expert.gate_up_proj.weight").value, Tensor());
    swiglu_packed_forward(ctx, Tensor(sh.data(), {N, S}, DType::F32), Tensor(sgu.data(), {N, 2 * S}, DType::F32));
    linear_forward(ctx, Tensor(base.data(), {N, C}, DType::F32), Tensor(sh.data(), {N, S}, DType::F32),
                   l.param("layers.0.mlp.shared_expert.down_proj.weight").value, Tensor());
    for (int64_t i = 0; i < N * C; ++i) base[i] = base[i] + l.skip.data<float>()[i];
  } else {
    for (int64_t i = 0; i < N * C; ++i) base[i] = l.skip.data<float>()[i];
  }
  std::vector<float> want(N * C);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0;
      for (int64_t j = 0; j < k; ++j)
        acc = std::fma(gates[t * k + j], ye[(ids[t * k + j] * N + t) * C + c], acc);
      want[t * C + c] = base[t * C + c] + acc;
    }
  return want;
}

void expect_bitwise_dense(const MoeDims& m) {
  Layer l(m, DType::F32);
  l.loss();
  const std::vector<float> want = dense_reference(l);
  int64_t differ = 0;
  for (int64_t i = 0; i < l.N * Layer::C; ++i) differ += std::memcmp(&want[i], l.out.data<float>() + i, 4) != 0;
  EXPECT_EQ(differ, 0) << "of " << l.N * Layer::C << " outputs";
}

TEST(MoeFeedForward, ForwardEqualsADensePerTokenLoopBitwise) {
  expect_bitwise_dense(options(RouterScore::Softmax, MoeAuxLoss::None, 0));
  expect_bitwise_dense(options(RouterScore::Sigmoid, MoeAuxLoss::None, 3));
  MoeDims skewed = options(RouterScore::Sigmoid, MoeAuxLoss::None, 3);
  skewed.normalize = false;
  expect_bitwise_dense(skewed);
}

TEST(MoeFeedForward, ForwardWithABiasEqualsTheDenseLoopWithIt) {
  Layer l(options(RouterScore::Softmax, MoeAuxLoss::None, 3), DType::F32);
  l.ffn.set_bias({0.3, -0.2, 0.1, 0.05});
  l.loss();
  const std::vector<float> want = dense_reference(l);
  for (int64_t i = 0; i < l.N * Layer::C; ++i) ASSERT_EQ(want[i], l.out.data<float>()[i]) << i;
}

// Every parameter tensor and the input, sampled, against central differences in float64.
void check_gradients(const MoeDims& m) {
  SCOPED_TRACE(::testing::Message() << "score " << int(m.score) << " aux " << int(m.aux_loss) << " shared "
                                    << m.shared_hidden);
  Layer l(m, DType::F64);
  l.loss();
  l.backward();
  const double h = 1e-6;
  auto check = [&](const std::string& what, const Tensor& value, const Tensor& grad) {
    double* v = value.data<double>();
    std::vector<double> fd, an;
    const int64_t n = value.numel(), samples = std::min<int64_t>(24, n);
    for (int64_t s = 0; s < samples; ++s) {
      const int64_t i = samples == n ? s : int64_t(rng_below(3, name_stream(what), uint64_t(s), uint64_t(n)));
      fd.push_back(test::central_difference(v[i], h, [&] { return l.loss(); }));
      an.push_back(grad.data<double>()[i]);
    }
    EXPECT_LT(test::normwise_error(fd, an), 1e-6) << what;
  };
  for (const Parameter& p : l.params) check(p.name, p.value, p.grad);
  check("x", l.x, l.tp.partial());
}

TEST(MoeFeedForward, GradientsMatchFiniteDifferences) {
  check_gradients(options(RouterScore::Softmax, MoeAuxLoss::None, 0));
  check_gradients(options(RouterScore::Sigmoid, MoeAuxLoss::None, 3));
  check_gradients(options(RouterScore::Softmax, MoeAuxLoss::Global, 3));
  check_gradients(options(RouterScore::Sigmoid, MoeAuxLoss::Sequence, 0));
}

TEST(MoeFeedForward, TheBalanceLossIsReportedApartAndMovesTheRouterGradient) {
  Layer off(options(RouterScore::Softmax, MoeAuxLoss::None, 0), DType::F64);
  Layer on(options(RouterScore::Softmax, MoeAuxLoss::Global, 0), DType::F64);
  off.ffn.begin_forward(0.1);
  on.ffn.begin_forward(0.1);
  off.ffn.forward(off.ctx, off.tp, off.out, off.a, off.x, off.skip);
  on.ffn.forward(on.ctx, on.tp, on.out, on.a, on.x, on.skip);
  EXPECT_EQ(off.ffn.take_aux_loss(), 0.0);
  const double aux = on.ffn.take_aux_loss();
  // 0 < alpha E sum_e f_e P_e <= alpha E (f and P each sum to 1).
  EXPECT_GT(aux, 0.0);
  EXPECT_LE(aux, 0.3 * 4);
  EXPECT_EQ(on.ffn.take_aux_loss(), 0.0);  // taken once
  for (int64_t i = 0; i < on.out.numel(); ++i) ASSERT_EQ(on.out.data<double>()[i], off.out.data<double>()[i]);
  off.backward();
  on.backward();
  const Parameter& r_off = off.param("layers.0.mlp.gate.weight");
  const Parameter& r_on = on.param("layers.0.mlp.gate.weight");
  double diff = 0;
  for (int64_t i = 0; i < r_on.grad.numel(); ++i) diff += std::abs(r_on.grad.data<double>()[i] - r_off.grad.data<double>()[i]);
  EXPECT_GT(diff, 1e-6);
  // An eval forward (dloss 0) adds nothing.
  on.ffn.begin_forward(0.0);
  on.ffn.forward(on.ctx, on.tp, on.out, on.a, on.x, on.skip);
  EXPECT_EQ(on.ffn.take_aux_loss(), 0.0);
}

// The balance loss's value by hand: 4 tokens, 2 experts, top-1; the first
// two tokens choose expert 0, the last two expert 1.
TEST(MoeFeedForward, TheBalanceLossPerSequenceAndGlobal) {
  std::vector<double> scores = {0.9, 0.1, 0.8, 0.2, 0.3, 0.7, 0.4, 0.6};
  std::vector<int32_t> ids = {0, 0, 1, 1};
  const Tensor s(scores.data(), {4, 2}, DType::F64), id(ids.data(), {4, 1}, DType::I32);
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {  // rows sum to 1: p = s either way
    const RouterOptions opt{.score = score, .top_k = 1};
    // Global: f = (1/2, 1/2), P = (0.6, 0.4): alpha E sum f P = alpha.
    EXPECT_NEAR(router_aux_loss(KernelContext{}, Tensor(), id, s, 1, 0.1, 0.0, opt), 0.1, 1e-15);
    // Per sequence of 2: f = (1, 0), P = (0.85, 0.15); f = (0, 1), P = (0.35, 0.65): alpha (0.85 + 0.65) E / 2.
    EXPECT_NEAR(router_aux_loss(KernelContext{}, Tensor(), id, s, 2, 0.1, 0.0, opt), 0.15, 1e-15);
  }
}

TEST(MoeFeedForward, ForcedBalanceGivesExactlyEqualLoads) {
  MoeDims m = options(RouterScore::Softmax, MoeAuxLoss::None, 0);
  m.force_balance = true;
  Layer l(m, DType::F32);  // 10 tokens x 2 choices over 4 experts: 5 each
  l.param("layers.0.mlp.gate.weight").value.data<float>()[0] = 50.f;  // a router that prefers expert 0
  l.loss();
  for (int64_t t = 0; t < l.N; ++t)
    for (int64_t j = 0; j < 2; ++j) EXPECT_EQ(l.a.moe.ids.data<int32_t>()[t * 2 + j], (t * 2 + j) % 4);
  EXPECT_EQ(l.ffn.step_loads(), (std::vector<int64_t>{5, 5, 5, 5}));
  l.ffn.end_step(l.ctx);
  EXPECT_EQ(l.ffn.last_imbalance(), 1.0);
  EXPECT_EQ(l.ffn.bias(), (std::vector<double>{0, 0, 0, 0}));  // equal loads: no expert moves
  // The bitwise dense reference holds with forced choices too.
  const std::vector<float> want = dense_reference(l);
  for (int64_t i = 0; i < l.N * Layer::C; ++i) ASSERT_EQ(want[i], l.out.data<float>()[i]) << i;
}

TEST(MoeFeedForward, TheBiasChangesTheSelectionButNotTheGates) {
  Layer l(options(RouterScore::Sigmoid, MoeAuxLoss::None, 0), DType::F32);
  l.loss();
  const int64_t N = l.N, E = 4, k = 2;
  const std::vector<int32_t> ids0(l.a.moe.ids.data<int32_t>(), l.a.moe.ids.data<int32_t>() + N * k);
  const std::vector<float> scores0(l.a.moe.scores.data<float>(), l.a.moe.scores.data<float>() + N * E);
  // Expert 3 made everyone's first choice by the bias alone.
  l.ffn.set_bias({0, 0, 0, 5.0});
  l.loss();
  const int32_t* ids = l.a.moe.ids.data<int32_t>();
  const float* gates = l.a.moe.gates.data<float>();
  const float* scores = l.a.moe.scores.data<float>();
  int changed = 0;
  for (int64_t t = 0; t < N; ++t) {
    EXPECT_EQ(ids[t * k], 3);
    changed += ids[t * k] != ids0[t * k] || ids[t * k + 1] != ids0[t * k + 1];
    double sel = 0;
    for (int64_t j = 0; j < k; ++j) sel += double(scores[t * E + ids[t * k + j]]);
    for (int64_t j = 0; j < k; ++j)  // the raw scores, normalised: no trace of the 5.0
      EXPECT_EQ(gates[t * k + j], scores[t * E + ids[t * k + j]] * float(1.0 / sel)) << t << "," << j;
  }
  EXPECT_GT(changed, 0);
  for (int64_t i = 0; i < N * E; ++i) ASSERT_EQ(scores[i], scores0[i]);  // the scores do not see the bias
}

TEST(MoeFeedForward, TheBiasMovesAgainstTheLoadAfterEachStep) {
  MoeDims m = options(RouterScore::Sigmoid, MoeAuxLoss::None, 0);
  m.bias_update_rate = 0.25;
  Layer l(m, DType::F32);
  l.loss();
  const std::vector<int64_t> loads = l.ffn.step_loads();
  int64_t total = 0;
  for (int64_t c : loads) total += c;
  EXPECT_EQ(total, l.N * 2);
  l.ffn.end_step(l.ctx);
  EXPECT_EQ(l.ffn.last_loads(), loads);
  for (size_t e = 0; e < 4; ++e) {
    const double mean = double(total) / 4, want = loads[e] < mean ? 0.25 : loads[e] > mean ? -0.25 : 0.0;
    EXPECT_EQ(l.ffn.bias()[e], want) << e;
  }
  EXPECT_EQ(l.ffn.step_loads(), (std::vector<int64_t>{0, 0, 0, 0}));  // the next step counts afresh
}

// A router initialised to send most tokens to expert 0, fixed random data,
// no training: the bias update alone brings max/mean load to <= 1.1.
TEST(MoeFeedForward, TheBiasBalancesASkewedRouterWithin300Steps) {
  MoeDims m;
  m.num_experts = 8;
  m.top_k = 2;
  m.score = RouterScore::Sigmoid;
  m.bias_update_rate = 0.004;
  Layer l(m, DType::F32, /*batch=*/8, /*seq=*/64);
  float* w = l.param("layers.0.mlp.gate.weight").value.data<float>();
  for (int64_t c = 0; c < Layer::C; ++c) w[c] = 0;
  for (int64_t t = 0; t < l.N; ++t) l.x.data<float>()[t * Layer::C] = 2.0f + std::abs(l.x.data<float>()[t * Layer::C]);
  w[0] = 3.0f;  // expert 0 scores sigmoid(6 or more) on every token
  l.loss();
  l.ffn.end_step(l.ctx);
  const double first = l.ffn.last_imbalance();
  EXPECT_GT(first, 3.0);
  int reached = -1;
  double worst_late = 0;  // once balanced it stays so: the bias oscillates by gamma around the balance
  for (int step = 1; step <= 300; ++step) {
    l.loss();
    l.ffn.end_step(l.ctx);
    if (reached < 0 && l.ffn.last_imbalance() <= 1.1) reached = step;
    if (step > 200) worst_late = std::max(worst_late, l.ffn.last_imbalance());
  }
  std::printf("max/mean load <= 1.1 at step %d (from %.3f); worst of steps 201-300 %.3f\n", reached, first,
              worst_late);
  EXPECT_GT(reached, 0) << "max/mean load " << l.ffn.last_imbalance() << " after 300 steps (from " << first << ")";
  EXPECT_LE(worst_late, 1.1);
}

}  // namespace
}  // namespace xirang
