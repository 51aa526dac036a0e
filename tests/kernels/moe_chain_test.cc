// The MoE kernels chained as the feed-forward layer will chain them, in
// float64 on one rank: router -> permutation -> permute -> grouped product
// -> combine, against a dense per-token reference (y_t = sum_j g_tj x_t
// W_{e_tj}), and the chained backwards against central differences in the
// router logits, the expert weights and the token rows.
#include "kernels/moe.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr int64_t T = 11, E = 6, K = 2, IN = 5, OUT = 4;

struct Chain {
  Vec logits = randn(T * E, 8101, 1.5), bias = randn(E, 8102, 0.2), w = randn(E * IN * OUT, 8103),
      x = randn(T * IN, 8104), R = randn(T * OUT, 8105);
  RouterOptions opt{RouterScore::Sigmoid, K, true};
  std::vector<int32_t> ids = std::vector<int32_t>(T * K), counts = std::vector<int32_t>(E),
                       sorted = std::vector<int32_t>(T * K), rows = std::vector<int32_t>(T * K),
                       offsets = std::vector<int32_t>(E + 1);
  Vec gates = Vec(T * K), scores = Vec(T * E), xp = Vec(T * K * IN), yp = Vec(T * K * OUT), y = Vec(T * OUT);
  KernelContext ctx;

  double forward() {
    router_forward(ctx, view(ids, {T, K}), view(gates, {T, K}), view(scores, {T, E}), view(counts, {E}),
                   view(logits, {T, E}), view(bias, {E}), opt);
    moe_permutation(ctx, view(sorted, {T * K}), view(rows, {T * K}), view(offsets, {E + 1}), view(ids, {T, K}), E);
    moe_permute(ctx, view(xp, {T * K, IN}), view(x, {T, IN}), view(sorted, {T * K}));
    grouped_matmul_forward(ctx, view(yp, {T * K, OUT}), view(xp, {T * K, IN}), view(w, {E, IN, OUT}),
                           view(offsets, {E + 1}));
    moe_unpermute_combine(ctx, view(y, {T, OUT}), view(yp, {T * K, OUT}), view(gates, {T, K}), view(rows, {T * K}));
    double L = 0;
    for (int64_t i = 0; i < T * OUT; ++i) L += y[i] * R[i];
    return L;
  }
};

TEST(MoeChain, ForwardEqualsDenseReference) {
  Chain c;
  c.forward();
  Vec want(T * OUT, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = c.ids[t * K + j];
      for (int64_t o = 0; o < OUT; ++o) {
        double s = 0;
        for (int64_t i = 0; i < IN; ++i) s += c.x[t * IN + i] * c.w[(e * IN + i) * OUT + o];
        want[t * OUT + o] += c.gates[t * K + j] * s;
      }
    }
  expect_near(c.y, want, 1e-12, "y");
}

TEST(MoeChain, GradientCheck) {
  Chain c;
  c.forward();
  Vec dyp(T * K * OUT), dgates(T * K), dxp(T * K * IN), dw(E * IN * OUT, 0.0), dx(T * IN), dlogits(T * E);
  moe_unpermute_combine_backward(c.ctx, view(dyp, {T * K, OUT}), view(dgates, {T, K}), view(c.R, {T, OUT}),
                                 view(c.yp, {T * K, OUT}), view(c.gates, {T, K}), view(c.rows, {T * K}));
  grouped_matmul_backward(c.ctx, view(dxp, {T * K, IN}), view(dw, {E, IN, OUT}), view(dyp, {T * K, OUT}),
                          view(c.xp, {T * K, IN}), view(c.w, {E, IN, OUT}), view(c.offsets, {E + 1}),
                          GradMode::Overwrite);
  moe_permute_backward(c.ctx, view(dx, {T, IN}), view(dxp, {T * K, IN}), view(c.rows, {T * K}));
  router_backward(c.ctx, view(dlogits, {T, E}), view(dgates, {T, K}), view(c.ids, {T, K}), view(c.scores, {T, E}),
                  c.opt);
  const std::vector<int32_t> chosen = c.ids;
  bool same = true;  // every perturbed forward keeps the selection (a flip would make the numeric gradient meaningless)
  auto loss = [&] {
    const double L = c.forward();
    same = same && c.ids == chosen;
    return L;
  };
  EXPECT_LT(normwise_error(numeric_gradient(c.logits, 1e-6, loss), dlogits), 1e-7) << "logits";
  EXPECT_LT(normwise_error(numeric_gradient(c.w, 1e-6, loss), dw), 1e-7) << "expert weights";
  EXPECT_LT(normwise_error(numeric_gradient(c.x, 1e-6, loss), dx), 1e-7) << "token rows";
  EXPECT_TRUE(same) << "a perturbation changed a selection: pick other seeds";
}

}  // namespace
}  // namespace xirang::test
