// Tests for the MoE permutation (kernels/moe.h): the stable sort by expert
// against std::stable_sort, dispatch + per-expert work + combine against a
// dense per-token loop (bitwise, every storage type), and the backwards
// against float64 references and central differences.
//
// Tolerances of the backwards, relative to max(1, max |ref|): F64 1e-12;
// F32 1e-6 (k = 3 products or sums per output); BF16/F16 2u (one rounding
// of a float result) for dyp and dx; dgates are F32 sums of d = 24 products
// of stored values, summed in double: 1e-6.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/moe.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr int64_t T = 29, k = 3, E = 8, D = 24;

// Expert ids in [0, 6) with experts 2, 6 and 7 never chosen (empty ranges);
// repeats within a token are allowed: the permutation does not need them distinct.
std::vector<int32_t> random_ids(uint64_t seed) {
  std::vector<int32_t> ids = rand_int(T * k, seed, 0, 5);
  for (auto& e : ids) e = e >= 2 ? e + 1 : e;
  return ids;
}

struct Perm {
  std::vector<int32_t> sorted, rows, offsets;
};
Perm run_permutation(std::vector<int32_t>& ids) {
  Perm p{std::vector<int32_t>(T * k, -1), std::vector<int32_t>(T * k, -1), std::vector<int32_t>(E + 1, -1)};
  KernelContext ctx;
  moe_permutation(ctx, view(p.sorted, {T * k}), view(p.rows, {T * k}), view(p.offsets, {E + 1}), view(ids, {T, k}), E);
  return p;
}

TEST(MoePermutation, StableSortByExpert) {
  std::vector<int32_t> ids = random_ids(6101);
  Perm p = run_permutation(ids);
  std::vector<int32_t> want(T * k);
  std::iota(want.begin(), want.end(), 0);
  std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  EXPECT_EQ(p.sorted, want);
  std::vector<int32_t> offsets(E + 1, 0);
  for (int32_t e : ids) ++offsets[e + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  EXPECT_EQ(p.offsets, offsets);
  EXPECT_EQ(p.offsets[3], p.offsets[2]) << "expert 2 should be empty";
  for (int64_t r = 0; r < T * k; ++r) EXPECT_EQ(p.rows[p.sorted[r]], r) << "slot_rows is not the inverse at row " << r;
}

TEST(MoePermutation, RejectsExpertOutOfRange) {
  std::vector<int32_t> ids = random_ids(6102);
  ids[5] = E;
  expect_error([&] { run_permutation(ids); }, ErrorKind::Shape, {"moe_permutation", "slot 5"});
}

// Rows are read by the index's values: one outside [0, T k) is refused before any read.
TEST(MoePermutation, RejectsIndexOutOfRange) {
  std::vector<int32_t> ids = random_ids(6103);
  const Perm p = run_permutation(ids);
  std::vector<float> x = cast_vec<float>(randn(T * D, 6104)), xp(size_t(T * k * D));
  KernelContext ctx;
  std::vector<int32_t> bad = p.sorted;
  bad[7] = int32_t(T * k);
  expect_error([&] { moe_permute(ctx, view(xp, {T * k, D}), view(x, {T, D}), view(bad, {T * k})); },
               ErrorKind::Shape, {"moe_permute", "sorted_slots[7]"});
  bad[7] = -1;
  expect_error([&] { moe_permute_backward(ctx, view(x, {T, D}), view(xp, {T * k, D}), view(bad, {T * k})); },
               ErrorKind::Shape, {"moe_permute_backward", "slot_rows[7] is -1"});
}

template <class S>
class MoePermuteTest : public ::testing::Test {};
using AllStorage = ::testing::Types<double, float, bf16, f16>;
TYPED_TEST_SUITE(MoePermuteTest, AllStorage);

template <class S>
using Compute = std::conditional_t<std::is_same_v<S, double>, double, float>;

template <class S>
S to_storage(Compute<S> v) {
  return cast_vec<S>(Vec{double(v)})[0];  // one rounding: v is exact in double
}

// The work an expert does to a row in this test: a different affine map
// per expert, computed in the compute type and stored once.
template <class S>
S expert_fn(int32_t e, S v, int64_t c) {
  using C = Compute<S>;
  return to_storage<S>(C(as_double(v)) * C(0.25 * (e + 1)) + C(0.01 * c));
}

TYPED_TEST(MoePermuteTest, DispatchCombineEqualsDenseLoopBitwise) {
  using S = TypeParam;
  using C = Compute<S>;
  std::vector<int32_t> ids = random_ids(6201);
  Perm p = run_permutation(ids);
  auto x = cast_vec<S>(randn(T * D, 6202));
  auto gates = cast_vec<C>(randu(T * k, 6203, 0.05, 1.0));
  KernelContext ctx;
  auto xp = cast_vec<S>(randn(T * k * D, 6204));
  moe_permute(ctx, view(xp, {T * k, D}), view(x, {T, D}), view(p.sorted, {T * k}));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = p.offsets[e]; r < p.offsets[e + 1]; ++r)
      for (int64_t c = 0; c < D; ++c) xp[r * D + c] = expert_fn<S>(int32_t(e), xp[r * D + c], c);
  auto y = cast_vec<S>(randn(T * D, 6205));
  std::vector<int32_t> rows = p.rows;
  moe_unpermute_combine(ctx, view(y, {T, D}), view(xp, {T * k, D}), view(gates, {T, k}), view(rows, {T * k}));
  // The dense loop: each token through its k experts in slot order.
  std::vector<S> want(T * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) {
      C acc = 0;
      for (int64_t j = 0; j < k; ++j)
        acc = std::fma(gates[t * k + j], C(as_double(expert_fn<S>(ids[t * k + j], x[t * D + c], c))), acc);
      want[t * D + c] = to_storage<S>(acc);
    }
  EXPECT_EQ(bytes_of(y), bytes_of(want));
}

template <class S>
double tolerance() {
  if constexpr (std::is_same_v<S, double>) return 1e-12;
  else if constexpr (std::is_same_v<S, float>) return 1e-6;
  else return 2 * unit_roundoff<S>();
}

TYPED_TEST(MoePermuteTest, BackwardsMatchFloat64) {
  using S = TypeParam;
  using C = Compute<S>;
  std::vector<int32_t> ids = random_ids(6301);
  Perm p = run_permutation(ids);
  const Vec yp = rounded<S>(randn(T * k * D, 6302)), dy = rounded<S>(randn(T * D, 6303));
  const Vec gates = rounded<C>(randu(T * k, 6304, 0.05, 1.0)), dxp = rounded<S>(randn(T * k * D, 6305));
  Vec want_dyp(T * k * D), want_dg(T * k, 0.0), want_dx(T * D, 0.0);
  for (int64_t s = 0; s < T * k; ++s) {
    const int64_t t = s / k, r = p.rows[s];
    for (int64_t c = 0; c < D; ++c) {
      want_dyp[r * D + c] = gates[s] * dy[t * D + c];
      want_dg[s] += yp[r * D + c] * dy[t * D + c];
      want_dx[t * D + c] += dxp[r * D + c];
    }
  }
  auto syp = cast_vec<S>(yp), sdy = cast_vec<S>(dy), sdxp = cast_vec<S>(dxp);
  auto sg = cast_vec<C>(gates);
  auto out_dyp = cast_vec<S>(randn(T * k * D, 6306)), out_dx = cast_vec<S>(randn(T * D, 6307));
  auto out_dg = cast_vec<C>(randn(T * k, 6308));
  KernelContext ctx;
  moe_unpermute_combine_backward(ctx, view(out_dyp, {T * k, D}), view(out_dg, {T, k}), view(sdy, {T, D}),
                                 view(syp, {T * k, D}), view(sg, {T, k}), view(p.rows, {T * k}));
  moe_permute_backward(ctx, view(out_dx, {T, D}), view(sdxp, {T * k, D}), view(p.rows, {T * k}));
  expect_near(out_dyp, want_dyp, tolerance<S>(), "dyp");
  expect_near(out_dx, want_dx, tolerance<S>(), "dx");
  expect_near(out_dg, want_dg, std::is_same_v<S, double> ? 1e-12 : 1e-6, "dgates");
}

// L = sum(combine(permute(x) * per-row weights) * R) in float64: the
// backwards of permute and combine, chained, against central differences
// in x and in the gates.
TEST(MoePermutation, GradientCheck) {
  std::vector<int32_t> ids = random_ids(6401);
  Perm p = run_permutation(ids);
  Vec x = randn(T * D, 6402), gates = randu(T * k, 6403, 0.05, 1.0), R = randn(T * D, 6404);
  const Vec wrow = randn(T * k, 6405);  // a different weight per expert-ordered row
  Vec xp(T * k * D), y(T * D);
  KernelContext ctx;
  auto loss = [&] {
    moe_permute(ctx, view(xp, {T * k, D}), view(x, {T, D}), view(p.sorted, {T * k}));
    for (int64_t i = 0; i < T * k * D; ++i) xp[i] *= wrow[i / D];
    moe_unpermute_combine(ctx, view(y, {T, D}), view(xp, {T * k, D}), view(gates, {T, k}), view(p.rows, {T * k}));
    double L = 0;
    for (int64_t i = 0; i < T * D; ++i) L += y[i] * R[i];
    return L;
  };
  loss();
  Vec dxp(T * k * D), dg(T * k), dx(T * D);
  moe_unpermute_combine_backward(ctx, view(dxp, {T * k, D}), view(dg, {T, k}), view(R, {T, D}), view(xp, {T * k, D}),
                                 view(gates, {T, k}), view(p.rows, {T * k}));
  for (int64_t i = 0; i < T * k * D; ++i) dxp[i] *= wrow[i / D];
  moe_permute_backward(ctx, view(dx, {T, D}), view(dxp, {T * k, D}), view(p.rows, {T * k}));
  EXPECT_LT(normwise_error(numeric_gradient(gates, 1e-6, loss), dg), 1e-8);
  EXPECT_LT(normwise_error(numeric_gradient(x, 1e-6, loss), dx), 1e-8);
}

}  // namespace
}  // namespace xirang::test
