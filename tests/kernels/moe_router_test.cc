// Tests for the MoE router (kernels/moe.h) against a float64 reference
// written from the definition: scores, top-k by biased score with ties to
// the lower index, gates from the raw scores, optional normalisation,
// counts; and a finite-difference check of the float64 backward.
//
// Tolerances: ids and counts exact. Gates: F64 1e-12 (the same formula in
// another order); F32 1e-6 (a softmax of E <= 16 terms in float: a few ulps
// of values <= 1). Inputs are random normals, so near-ties between biased
// scores that float rounding could flip are ~1e-7 likely per pair; the
// seeds are fixed.
#include <algorithm>
#include <cmath>

#include "kernels/moe.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

struct RefRoute {
  std::vector<int32_t> ids, counts;
  Vec gates, scores;
};

RefRoute ref_route(const Vec& logits, const Vec& bias, int64_t T, int64_t E, const RouterOptions& o) {
  const int64_t k = o.top_k;
  RefRoute r{std::vector<int32_t>(T * k), std::vector<int32_t>(E, 0), Vec(T * k), Vec(T * E)};
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[t * E + e]);
    for (int64_t e = 0; e < E; ++e) {
      const double l = logits[t * E + e];
      r.scores[t * E + e] = o.score == RouterScore::Softmax ? std::exp(l) / sum : 1.0 / (1.0 + std::exp(-l));
    }
    // Order experts by (biased score descending, index ascending).
    std::vector<int32_t> order(E);
    for (int64_t e = 0; e < E; ++e) order[e] = int32_t(e);
    auto biased = [&](int32_t e) { return r.scores[t * E + e] + (bias.empty() ? 0.0 : bias[e]); };
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return biased(a) > biased(b); });
    double sel = 0;
    for (int64_t j = 0; j < k; ++j) sel += r.scores[t * E + order[j]];
    for (int64_t j = 0; j < k; ++j) {
      r.ids[t * k + j] = order[j];
      r.gates[t * k + j] = r.scores[t * E + order[j]] / (o.normalize ? sel : 1.0);
      ++r.counts[order[j]];
    }
  }
  return r;
}

struct Case {
  RouterScore score;
  bool normalize, bias;
};
const Case kCases[] = {{RouterScore::Softmax, true, false},
                       {RouterScore::Softmax, false, false},
                       {RouterScore::Sigmoid, true, true},
                       {RouterScore::Sigmoid, false, true},
                       {RouterScore::Softmax, true, true}};

template <class T>
void check_forward(const Case& c, double tolerance) {
  const int64_t T_ = 37, E = 16, k = 4;
  const RouterOptions o{c.score, k, c.normalize};
  // A bias of the scores' scale, so that it changes many selections.
  const Vec logits = rounded<T>(randn(T_ * E, 5101, 1.5));
  const Vec bias = c.bias ? rounded<T>(randn(E, 5102, 0.3)) : Vec{};
  const RefRoute want = ref_route(logits, bias, T_, E, o);
  auto l = cast_vec<T>(logits), b = cast_vec<T>(bias);
  auto gates = cast_vec<T>(randn(T_ * k, 5103)), scores = cast_vec<T>(randn(T_ * E, 5104));
  std::vector<int32_t> ids(T_ * k, -7), counts(E, -7);
  KernelContext ctx;
  router_forward(ctx, view(ids, {T_, k}), view(gates, {T_, k}), view(scores, {T_, E}), view(counts, {E}),
                 view(l, {T_, E}), c.bias ? view(b, {E}) : Tensor(), o);
  EXPECT_EQ(ids, want.ids);
  EXPECT_EQ(counts, want.counts);
  expect_near(gates, want.gates, tolerance, "gates");
  expect_near(scores, want.scores, tolerance, "scores");
  if (c.bias) {  // the bias must matter here, or the test would not see it misused
    const RefRoute unbiased = ref_route(logits, Vec{}, T_, E, o);
    EXPECT_NE(unbiased.ids, want.ids);
  }
}

TEST(MoeRouter, ForwardF64) {
  for (const Case& c : kCases) check_forward<double>(c, 1e-12);
}
TEST(MoeRouter, ForwardF32) {
  for (const Case& c : kCases) check_forward<float>(c, 1e-6);
}

// Equal logits: the lower expert index wins, every time.
TEST(MoeRouter, TiesGoToTheLowerIndex) {
  const int64_t T = 3, E = 6, k = 3;
  std::vector<float> l = {0.5f, 2, 2, 0.5f, 2, 1,  1, 1, 1, 1, 1, 1,  -1, 3, -1, 3, 0, 3};
  std::vector<int32_t> ids(T * k), counts(E);
  std::vector<float> gates(T * k), scores(T * E);
  KernelContext ctx;
  for (int rep = 0; rep < 2; ++rep) {
    router_forward(ctx, view(ids, {T, k}), view(gates, {T, k}), view(scores, {T, E}), view(counts, {E}),
                   view(l, {T, E}), Tensor(), {RouterScore::Sigmoid, k, true});
    EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 4, 0, 1, 2, 1, 3, 5}));
  }
}

// L = sum(gates * R): the backward against central differences in float64.
TEST(MoeRouter, GradientCheck) {
  const int64_t T = 9, E = 8, k = 3;
  for (const Case& c : kCases) {
    const RouterOptions o{c.score, k, c.normalize};
    Vec logits = randn(T * E, 5201, 1.5);
    Vec bias = c.bias ? randn(E, 5202, 0.3) : Vec{};
    Vec R = randn(T * k, 5203);
    std::vector<int32_t> ids(T * k), counts(E);
    Vec gates(T * k), scores(T * E), dlogits(T * E, 11.0);
    KernelContext ctx;
    auto forward = [&] {
      router_forward(ctx, view(ids, {T, k}), view(gates, {T, k}), view(scores, {T, E}), view(counts, {E}),
                     view(logits, {T, E}), c.bias ? view(bias, {E}) : Tensor(), o);
      double L = 0;
      for (int64_t i = 0; i < T * k; ++i) L += gates[i] * R[i];
      return L;
    };
    forward();
    const std::vector<int32_t> chosen = ids;
    router_backward(ctx, view(dlogits, {T, E}), view(R, {T, k}), view(ids, {T, k}), view(scores, {T, E}), o);
    bool same = true;  // checked after every perturbed forward, not only the last
    const Vec numeric = numeric_gradient(logits, 1e-6, [&] {
      const double L = forward();
      same = same && ids == chosen;
      return L;
    });
    EXPECT_TRUE(same) << "a perturbation changed a selection: pick other seeds";
    EXPECT_LT(normwise_error(numeric, dlogits), 1e-7) << "score " << int(c.score) << " normalize " << c.normalize;
  }
}

TEST(MoeRouter, RejectsBadShapes) {
  std::vector<float> l(12), g(6), s(12);
  std::vector<int32_t> ids(6);
  KernelContext ctx;
  expect_error([&] {
    router_forward(ctx, view(ids, {3, 2}), view(g, {3, 2}), view(s, {3, 4}), Tensor(), view(l, {3, 4}), Tensor(),
                   {RouterScore::Softmax, 5, true});
  }, ErrorKind::Shape, {"router_forward", "top_k"});
}

}  // namespace
}  // namespace xirang::test
