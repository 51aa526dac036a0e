// Tests for the grouped product over experts (kernels/moe.h) against a
// float64 per-expert reference, on random ragged row counts with empty
// experts (first, middle and last), in every storage type.
//
// Tolerances, relative to max(1, max |ref|), as tests/kernels/matmul_test.cc
// justifies them for the same GEMM path: f64 1e-10; f32 1e-5 (dot products
// of <= 40 unit-scale terms: ~1e-6); 16-bit outputs 2u (inputs are rounded
// first, so only the one rounding of each stored output is left); dw beside
// 16-bit activations is F32 (summed into in float): 1e-5.
#include <numeric>

#include "kernels/moe.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr int64_t E = 7, IN = 24, OUT = 40;

// Ragged counts in [1, 9), then experts 0, 3 and 6 made empty.
std::vector<int32_t> ragged_offsets(uint64_t seed) {
  std::vector<int32_t> counts = rand_int(E, seed, 1, 9);
  counts[0] = counts[3] = counts[6] = 0;
  std::vector<int32_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

template <class S>
double tolerance() {
  if constexpr (is_16bit_v<S>) return 2 * unit_roundoff<S>();
  else return tol<S>(1e-5);
}

template <class S>
class GroupedMatmulTest : public ::testing::Test {};
using AllStorage = ::testing::Types<double, float, bf16, f16>;
TYPED_TEST_SUITE(GroupedMatmulTest, AllStorage);

TYPED_TEST(GroupedMatmulTest, ForwardAndBackwardMatchFloat64) {
  using S = TypeParam;
  using G = std::conditional_t<is_16bit_v<S>, float, S>;  // the gradient storage of dw
  std::vector<int32_t> off = ragged_offsets(7101);
  const int64_t R = off[E];
  const Vec x = rounded<S>(randn(R * IN, 7102)), w = rounded<S>(randn(E * IN * OUT, 7103));
  const Vec dy = rounded<S>(randn(R * OUT, 7104));
  const Vec dx0 = rounded<S>(randn(R * IN, 7105)), dw0 = rounded<G>(randn(E * IN * OUT, 7106));
  // The reference, expert by expert; rows of empty experts do not exist,
  // and their dw stays dw0.
  Vec y(R * OUT), dx = dx0, dw = dw0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; ++r)
      for (int64_t i = 0; i < IN; ++i)
        for (int64_t o = 0; o < OUT; ++o) {
          const double wv = w[(e * IN + i) * OUT + o];
          y[r * OUT + o] += x[r * IN + i] * wv;
          dx[r * IN + i] += dy[r * OUT + o] * wv;
          dw[(e * IN + i) * OUT + o] += x[r * IN + i] * dy[r * OUT + o];
        }
  auto sx = cast_vec<S>(x), sw = cast_vec<S>(w), sdy = cast_vec<S>(dy);
  auto sy = cast_vec<S>(randn(R * OUT, 7107)), sdx = cast_vec<S>(dx0);
  auto sdw = cast_vec<G>(dw0);
  KernelContext ctx;
  grouped_matmul_forward(ctx, view(sy, {R, OUT}), view(sx, {R, IN}), view(sw, {E, IN, OUT}), view(off, {E + 1}));
  expect_near(sy, y, tolerance<S>(), "y");
  // dx accumulated onto dx0, dw onto dw0: both modes of the one call.
  grouped_matmul_backward(ctx, view(sdx, {R, IN}), view(sdw, {E, IN, OUT}), view(sdy, {R, OUT}), view(sx, {R, IN}),
                          view(sw, {E, IN, OUT}), view(off, {E + 1}), GradMode::Accumulate);
  expect_near(sdx, dx, tolerance<S>(), "dx (accumulated)");
  expect_near(sdw, dw, tolerance<G>(), "dw");
  for (int64_t i = 0; i < IN * OUT; ++i)
    ASSERT_EQ(as_double(sdw[6 * IN * OUT + i]), dw0[6 * IN * OUT + i]) << "an empty expert's dw changed";
  // Overwrite, dx alone (dw undefined: skipped).
  Vec dx_only(R * IN, 0.0);
  for (int64_t i = 0; i < R * IN; ++i) dx_only[i] = dx[i] - dx0[i];
  grouped_matmul_backward(ctx, view(sdx, {R, IN}), Tensor(), view(sdy, {R, OUT}), view(sx, {R, IN}),
                          view(sw, {E, IN, OUT}), view(off, {E + 1}), GradMode::Overwrite);
  expect_near(sdx, dx_only, tolerance<S>(), "dx (overwritten)");
}

// Random sizes: many draws of counts (some all in one expert, some with
// every expert empty but one), each against the reference in f64.
TEST(GroupedMatmul, RandomRaggedSizes) {
  for (uint64_t seed = 0; seed < 12; ++seed) {
    std::vector<int32_t> counts = rand_int(E, 7200 + seed, 0, 6);
    if (seed % 4 == 0)
      for (int64_t e = 0; e < E; ++e) counts[e] = e == int64_t(seed % E) ? 11 : 0;
    std::vector<int32_t> off(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
    const int64_t R = off[E];
    Vec x = randn(R * IN, 7300 + seed), w = randn(E * IN * OUT, 7400 + seed), y(R * OUT, 3.0), want(R * OUT, 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = off[e]; r < off[e + 1]; ++r)
        for (int64_t i = 0; i < IN; ++i)
          for (int64_t o = 0; o < OUT; ++o) want[r * OUT + o] += x[r * IN + i] * w[(e * IN + i) * OUT + o];
    KernelContext ctx;
    grouped_matmul_forward(ctx, view(y, {R, OUT}), view(x, {R, IN}), view(w, {E, IN, OUT}), view(off, {E + 1}));
    expect_near(y, want, 1e-10, "y, seed " + std::to_string(seed));
  }
}

TEST(GroupedMatmul, RejectsBadOffsets) {
  std::vector<float> x(10 * IN), w(E * IN * OUT), y(10 * OUT);
  std::vector<int32_t> off = {0, 3, 2, 4, 5, 6, 8, 10};
  KernelContext ctx;
  expect_error([&] {
    grouped_matmul_forward(ctx, view(y, {10, OUT}), view(x, {10, IN}), view(w, {E, IN, OUT}), view(off, {E + 1}));
  }, ErrorKind::Shape, {"grouped_matmul_forward", "offsets decrease at expert 1"});
  off = {0, 1, 2, 3, 4, 5, 6, 9};
  expect_error([&] {
    grouped_matmul_forward(ctx, view(y, {10, OUT}), view(x, {10, IN}), view(w, {E, IN, OUT}), view(off, {E + 1}));
  }, ErrorKind::Shape, {"grouped_matmul_forward", "expected 0 to 10"});
}

}  // namespace
}  // namespace xirang::test
