// Tests for kernels/elementwise.h: GELU forward/backward (with a
// finite-difference check), add_bias, add, scale, zero, casts between every
// pair of float dtypes, sum_squares and all_finite.
//
// fp32 tolerance for GELU: 1e-5 of max(1, max|ref|). Each element is a
// handful of fp32 operations plus tanh (a few ulp); the derivative's
// 1 - tanh^2 cancels for |x| ~ 4, where its absolute error reaches ~5e-7.
// Everything else here is exact or a single rounding.
#include <cmath>
#include <cstring>
#include <limits>

#include <omp.h>

#include "core/dtype.h"
#include "kernels/elementwise.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
class ElementwiseTest : public ::testing::Test {
 protected:
  static constexpr int64_t N = 37, C = 48;
  KernelContext ctx;
  // Scale 2 covers the tails where tanh saturates as well as the centre.
  std::vector<T> x = cast_vec<T>(randn(N * C, 201, 2.0));
  std::vector<T> dy = cast_vec<T>(randn(N * C, 202));
};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ElementwiseTest, ComputeTypes);

TYPED_TEST(ElementwiseTest, GeluForward) {
  using T = TypeParam;
  auto& f = *this;
  auto y = cast_vec<T>(randn(f.N * f.C, 203));
  gelu_forward(f.ctx, view(y, {f.N, f.C}), view(f.x, {f.N, f.C}));
  Vec ref(f.x.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = ref_gelu(double(f.x[i]));
  expect_near(y, ref, tol<T>(kTolF32), "gelu y");
}

TYPED_TEST(ElementwiseTest, GeluBackward) {
  using T = TypeParam;
  auto& f = *this;
  auto dx = cast_vec<T>(randn(f.N * f.C, 204));
  gelu_backward(f.ctx, view(dx, {f.N, f.C}), view(f.dy, {f.N, f.C}), view(f.x, {f.N, f.C}));
  Vec ref(f.x.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = double(f.dy[i]) * ref_gelu_grad(double(f.x[i]));
  expect_near(dx, ref, tol<T>(kTolF32), "gelu dx");
}

// The MLP backward writes dx over dy in place; the header allows it.
TYPED_TEST(ElementwiseTest, GeluBackwardInPlace) {
  using T = TypeParam;
  auto& f = *this;
  Vec ref(f.x.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = double(f.dy[i]) * ref_gelu_grad(double(f.x[i]));
  Tensor d = view(f.dy, {f.N, f.C});
  gelu_backward(f.ctx, d, d, view(f.x, {f.N, f.C}));
  expect_near(f.dy, ref, tol<T>(kTolF32), "gelu dx aliasing dy");
}

// Central differences of L = sum(gelu(x) * R) in float64 against the F64
// kernel backward. GELU is elementwise, so dL/dx_i depends on x_i alone and
// each element is checked on its own (relative error per element < 1e-6,
// with a floor of 1e-3 on the denominator for elements near gelu' = 0).
TEST(GeluGradCheck, FiniteDifferences) {
  const int64_t n = 301;
  const double h = 1e-6;
  KernelContext ctx;
  Vec x = randn(n, 211, 2.0), R = randn(n, 212), y(n), dx(n);
  gelu_backward(ctx, view(dx, {n}), view(R, {n}), view(x, {n}));
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    double xi = x[i], yi = 0;
    auto loss = [&] {  // the one term of L that depends on x_i
      gelu_forward(ctx, Tensor(&yi, {1}, DType::F64), Tensor(&xi, {1}, DType::F64));
      return R[i] * yi;
    };
    double fd = central_difference(xi, h, loss);
    worst = std::max(worst, std::fabs(fd - dx[i]) / std::max(std::fabs(dx[i]), 1e-3));
  }
  EXPECT_LT(worst, 1e-6);
}

// out = a + b, also with out aliasing a and b (the residual stream adds in place).
TYPED_TEST(ElementwiseTest, AddIncludingAliases) {
  using T = TypeParam;
  auto& f = *this;
  Vec ref = plus(to_f64(f.x), to_f64(f.dy));
  auto out = cast_vec<T>(randn(f.N * f.C, 205));
  add(f.ctx, view(out, {f.N, f.C}), view(f.x, {f.N, f.C}), view(f.dy, {f.N, f.C}));
  expect_near(out, ref, tol<T>(2.5e-7), "add");  // one rounding (6e-8), with margin
  auto a = f.x, b = f.dy;
  add(f.ctx, view(a, {f.N, f.C}), view(a, {f.N, f.C}), view(b, {f.N, f.C}));
  expect_near(a, ref, tol<T>(2.5e-7), "add out=a");
  a = f.x;
  add(f.ctx, view(b, {f.N, f.C}), view(a, {f.N, f.C}), view(b, {f.N, f.C}));
  expect_near(b, ref, tol<T>(2.5e-7), "add out=b");
}

// y += bias on every row, over random prior y; also on a (B, T, C) view,
// whose leading dims are rows. One fp32 addition per element (6e-8
// relative); 2.5e-7 as for add.
TYPED_TEST(ElementwiseTest, AddBias) {
  using T = TypeParam;
  auto& f = *this;
  auto bias = cast_vec<T>(randn(f.C, 206));
  Vec ref = ref_add_bias(to_f64(f.x), to_f64(bias), f.N, f.C);
  auto y = f.x;
  add_bias(f.ctx, view(y, {f.N, f.C}), view(bias, {f.C}));
  expect_near(y, ref, tol<T>(2.5e-7), "add_bias");
  std::vector<T> y3(2 * 5 * f.C);
  std::copy(f.x.begin(), f.x.begin() + y3.size(), y3.begin());
  add_bias(f.ctx, view(y3, {2, 5, f.C}), view(bias, {f.C}));
  expect_near(y3, Vec(ref.begin(), ref.begin() + y3.size()), tol<T>(2.5e-7), "add_bias on (B, T, C)");
}

TEST(AddBias, WidthAndDtypeMismatchNameTheOp) {
  KernelContext ctx;
  std::vector<float> y(4 * 8), b7(7), b8(8);
  std::vector<double> b8_f64(8);
  expect_error([&] { add_bias(ctx, view(y, {4, 8}), view(b7, {7})); }, ErrorKind::Shape, {"add_bias"});
  expect_error([&] { add_bias(ctx, view(y, {4, 8}), view(b8, {1, 8})); }, ErrorKind::Shape, {"add_bias", "bias"});
  expect_error([&] { add_bias(ctx, view(y, {4, 8}), view(b8_f64, {8})); }, ErrorKind::Shape, {"add_bias", "bias"});
}

TYPED_TEST(ElementwiseTest, ScaleAndZero) {
  using T = TypeParam;
  auto& f = *this;
  const double s = -0.3719;
  Vec ref = to_f64(f.x);
  for (double& r : ref) r *= s;
  scale(f.ctx, view(f.x, {f.N, f.C}), s);
  expect_near(f.x, ref, tol<T>(2.5e-7), "scale");  // s may be rounded to float first: two roundings
  zero(f.ctx, view(f.x, {f.N, f.C}));
  for (size_t i = 0; i < f.x.size(); ++i) ASSERT_EQ(f.x[i], T(0)) << "zero left element " << i;
}

// sum_squares accumulates in double, so even the fp32 input gives the
// float64 sum of its exact values to ~1e-12 (n = 1776 terms).
TYPED_TEST(ElementwiseTest, SumSquares) {
  auto& f = *this;
  double ref = ref_sum_squares(to_f64(f.x));
  EXPECT_NEAR(sum_squares(f.ctx, view(f.x, {f.N, f.C})), ref, 1e-12 * ref);
}

// sum_squares also reads the 16-bit storage types (the optimizer's global
// norm over bf16 gradients): the double sum of the stored values.
TEST(SumSquares, SixteenBitStorage) {
  KernelContext ctx;
  const int64_t n = 1001;
  Vec v = randn(n, 206, 3.0);
  std::vector<bf16> b(n);
  std::vector<f16> h(n);
  double rb = 0, rh = 0;
  for (int64_t i = 0; i < n; ++i) {
    b[i] = float_to_bf16(float(v[i]));
    h[i] = float_to_f16(float(v[i]));
    rb += double(bf16_to_float(b[i])) * bf16_to_float(b[i]);
    rh += double(f16_to_float(h[i])) * f16_to_float(h[i]);
  }
  EXPECT_NEAR(sum_squares(ctx, Tensor(b.data(), {n}, DType::BF16)), rb, 1e-12 * rb);
  EXPECT_NEAR(sum_squares(ctx, Tensor(h.data(), {n}, DType::F16)), rh, 1e-12 * rh);
}

// Long tensors: sum_squares splits them into fixed chunks whatever the
// thread count, so 1, 2 and 3 threads give the same double bit for bit, and
// that double is the float64 sum (several chunks and a ragged tail here).
TEST(SumSquares, LongTensorSameForAnyThreadCount) {
  KernelContext ctx;
  const int64_t n = 5 * 32768 + 1234;
  const auto x = cast_vec<float>(randn(n, 207, 1.5));
  const double ref = ref_sum_squares(to_f64(x));
  const int saved = omp_get_max_threads();
  std::vector<double> got;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    got.push_back(sum_squares(ctx, Tensor(const_cast<float*>(x.data()), {n}, DType::F32)));
  }
  omp_set_num_threads(saved);
  EXPECT_NEAR(got[0], ref, 1e-12 * ref);
  EXPECT_EQ(got[0], got[1]);
  EXPECT_EQ(got[0], got[2]);
}

// zero() of a large tensor (the gradient arena) fills in parallel slices:
// every element of an unaligned, odd-length view becomes 0 and the
// elements either side of it keep their values.
TEST(Zero, LargeUnalignedViewAndItsNeighbours) {
  KernelContext ctx;
  const int64_t n = (int64_t(17) << 20) / 4 + 13, pad = 3;  // past the 16 MiB of the parallel fill
  std::vector<float> buf(size_t(n + 2 * pad), 0.0f);
  const Vec r = randn(n + 2 * pad, 208);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = float(r[i]) + 10.0f;  // never 0
  zero(ctx, Tensor(buf.data() + pad, {n}, DType::F32));
  for (int64_t i = 0; i < pad; ++i) {
    EXPECT_EQ(buf[size_t(i)], float(r[size_t(i)]) + 10.0f) << "before the view: " << i;
    EXPECT_EQ(buf[size_t(pad + n + i)], float(r[size_t(pad + n + i)]) + 10.0f) << "after the view: " << i;
  }
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += buf[size_t(pad + i)] != 0.0f;
  EXPECT_EQ(bad, 0) << "elements left non-zero";
}

// GELU runs in blocks: several blocks and a ragged tail, in f32 and bf16,
// against the float64 reference, and the same bits for 1 and 3 threads.
template <class S>
void gelu_long(uint64_t seed) {
  KernelContext ctx;
  const int64_t n = 3 * 512 + 37;
  const auto x = cast_vec<S>(randn(n, seed, 3.0)), dy = cast_vec<S>(randn(n, seed + 1));
  const Vec xr = to_f64(x), dyr = to_f64(dy);
  Vec yref(n), dref(n);
  for (int64_t i = 0; i < n; ++i) {
    yref[i] = ref_gelu(xr[i]);
    dref[i] = dyr[i] * ref_gelu_grad(xr[i]);
  }
  // f32: the fp32 tolerance above; 16-bit: one rounding to storage on top.
  const double tol_rel = std::is_same_v<S, float> ? kTolF32 : 1e-5 + unit_roundoff<S>();
  const int saved = omp_get_max_threads();
  std::vector<std::vector<S>> ys, dxs;
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    std::vector<S> y(n), dx(n);
    gelu_forward(ctx, view(y, {n}), Tensor(const_cast<S*>(x.data()), {n}, dtype_of<S>::value));
    gelu_backward(ctx, view(dx, {n}), Tensor(const_cast<S*>(dy.data()), {n}, dtype_of<S>::value),
                  Tensor(const_cast<S*>(x.data()), {n}, dtype_of<S>::value));
    ys.push_back(y);
    dxs.push_back(dx);
  }
  omp_set_num_threads(saved);
  const Vec y = to_f64(ys[0]), dx = to_f64(dxs[0]);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(y[i], yref[i], tol_rel * std::max(1.0, std::fabs(yref[i]))) << "gelu y " << i << " x " << xr[i];
    ASSERT_NEAR(dx[i], dref[i], tol_rel * std::max(1.0, std::fabs(dref[i]))) << "gelu dx " << i << " x " << xr[i];
  }
  EXPECT_EQ(0, std::memcmp(ys[0].data(), ys[1].data(), sizeof(S) * size_t(n))) << "y differs with 3 threads";
  EXPECT_EQ(0, std::memcmp(dxs[0].data(), dxs[1].data(), sizeof(S) * size_t(n))) << "dx differs with 3 threads";
}

TEST(GeluLong, F32AcrossBlocks) { gelu_long<float>(209); }
TEST(GeluLong, Bf16AcrossBlocks) { gelu_long<bf16>(211); }
TEST(GeluLong, F16AcrossBlocks) { gelu_long<f16>(213); }

// The accumulating forms add to a one-element f64 sum: several tensors in
// a row give the same double as adding sum_squares() results in that order
// (the trainer's global norm relies on it, so bitwise), and mean_accumulate
// adds the element-order mean of f32 or f64 losses.
TEST(AccumulatingReductions, AddToTheSumInCallOrder) {
  KernelContext ctx;
  Vec a = randn(777, 301, 2.0), b = randn(1500, 302, 0.5);
  std::vector<float> af(a.begin(), a.end());
  double acc = 1.25;  // a running sum that is not zero
  Tensor sum(&acc, {1}, DType::F64);
  sum_squares_accumulate(ctx, sum, Tensor(af.data(), {777}, DType::F32));
  sum_squares_accumulate(ctx, sum, Tensor(b.data(), {1500}, DType::F64));
  double expect = 1.25;
  expect += sum_squares(ctx, Tensor(af.data(), {777}, DType::F32));
  expect += sum_squares(ctx, Tensor(b.data(), {1500}, DType::F64));
  EXPECT_EQ(acc, expect);
  EXPECT_NEAR(acc, 1.25 + ref_sum_squares(to_f64(af)) + ref_sum_squares(b), 1e-12 * acc);

  double m = -0.5;
  Tensor msum(&m, {1}, DType::F64);
  mean_accumulate(ctx, msum, Tensor(af.data(), {777}, DType::F32));
  mean_accumulate(ctx, msum, Tensor(b.data(), {1500}, DType::F64));
  double ma = 0, mb = 0;
  for (float x : af) ma += x;
  for (double x : b) mb += x;
  EXPECT_NEAR(m, -0.5 + ma / 777 + mb / 1500, 1e-14);
}

TEST(AccumulatingReductions, RefuseAWrongAccumulator) {
  KernelContext ctx;
  std::vector<float> x(8, 1.5f);
  float f = 0;
  double two[2] = {0, 0};
  std::vector<bf16> h(8);
  double acc = 0;
  EXPECT_THROW(sum_squares_accumulate(ctx, Tensor(&f, {1}, DType::F32), Tensor(x.data(), {8}, DType::F32)), Error);
  EXPECT_THROW(sum_squares_accumulate(ctx, Tensor(two, {2}, DType::F64), Tensor(x.data(), {8}, DType::F32)), Error);
  EXPECT_THROW(mean_accumulate(ctx, Tensor(&acc, {1}, DType::F64), Tensor(h.data(), {8}, DType::BF16)), Error);
  EXPECT_EQ(acc, 0.0);
}

// ---------------------------------------------------------------- casts

// Stores v in a buffer of dtype `t` (rounding through the reference) and
// returns the bytes; read_as turns a buffer back into doubles.
std::vector<uint8_t> store_as(const Vec& v, DType t) {
  std::vector<uint8_t> bytes(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (t) {
      case DType::F32: { float x = float(v[i]); std::memcpy(&bytes[i * 4], &x, 4); break; }
      case DType::F64: std::memcpy(&bytes[i * 8], &v[i], 8); break;
      case DType::BF16: { bf16 x = float_to_bf16(float(v[i])); std::memcpy(&bytes[i * 2], &x, 2); break; }
      case DType::F16: { f16 x = float_to_f16(float(v[i])); std::memcpy(&bytes[i * 2], &x, 2); break; }
      default: ADD_FAILURE() << "not a float dtype";
    }
  }
  return bytes;
}

Vec read_as(const std::vector<uint8_t>& bytes, DType t) {
  Vec v(bytes.size() / dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (t) {
      case DType::F32: { float x; std::memcpy(&x, &bytes[i * 4], 4); v[i] = x; break; }
      case DType::F64: std::memcpy(&v[i], &bytes[i * 8], 8); break;
      case DType::BF16: { bf16 x; std::memcpy(&x, &bytes[i * 2], 2); v[i] = bf16_to_float(x); break; }
      case DType::F16: { f16 x; std::memcpy(&x, &bytes[i * 2], 2); v[i] = f16_to_float(x); break; }
      default: ADD_FAILURE() << "not a float dtype";
    }
  }
  return v;
}

// The value a conversion into `t` must produce: round to nearest even at t's
// precision (computed from the math in reference.h, not by core/dtype).
double ref_convert(double x, DType t) {
  switch (t) {
    case DType::F32: return double(float(x));
    case DType::F64: return x;
    case DType::BF16: return ref_round_bf16(x);
    case DType::F16: return ref_round_f16(x);
    default: return NAN;
  }
}

// Every direction between f32, f64, bf16 and f16. Inputs stay in f16's
// normal range (|x| in [2^-6, 2^6]) so one reference rule covers all four.
// The result must equal the reference exactly: a conversion is one
// correctly rounded operation. (A f64 source is rounded to float first by
// the reference; a direct f64 -> bf16 rounding differs only when the float
// rounding lands on a bf16 tie, probability ~2^-29 per element.)
TEST(Cast, EveryDirectionRoundsToNearest) {
  KernelContext ctx;
  const DType types[] = {DType::F32, DType::F64, DType::BF16, DType::F16};
  Vec v = randu(517, 221, -6.0, 6.0);
  Vec sign = randn(v.size(), 222);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::copysign(std::exp2(v[i]), sign[i]);
  for (DType from : types)
    for (DType to : types) {
      SCOPED_TRACE(testing::Message() << dtype_name(from) << " -> " << dtype_name(to));
      auto in = store_as(v, from);
      Vec src = read_as(in, from);  // the values the kernel sees
      std::vector<uint8_t> out(v.size() * dtype_size(to), 0xA5);
      cast(ctx, Tensor(out.data(), {int64_t(v.size())}, to), Tensor(in.data(), {int64_t(v.size())}, from));
      Vec got = read_as(out, to);
      int bad = 0;
      for (size_t i = 0; i < v.size() && bad < 5; ++i)
        if (got[i] != ref_convert(src[i], to))
          ++bad, ADD_FAILURE() << "[" << i << "] " << src[i] << " became " << got[i] << ", expected "
                               << ref_convert(src[i], to);
    }
}

// float -> bf16 -> float stays within 2^-8 relative (8 significant bits,
// half an ulp is 2^-8 of the leading bit), and values with at most 8
// significant bits come back exactly.
TEST(Cast, Bf16RoundTrip) {
  KernelContext ctx;
  const int64_t n = 1001;
  auto x = cast_vec<float>(randn(n, 231, 10.0));
  std::vector<bf16> mid(n);
  std::vector<float> back(n);
  cast(ctx, Tensor(mid.data(), {n}, DType::BF16), view(x, {n}));
  cast(ctx, view(back, {n}), Tensor(mid.data(), {n}, DType::BF16));
  for (int64_t i = 0; i < n; ++i) ASSERT_LE(std::fabs(back[i] - x[i]), std::ldexp(std::fabs(x[i]), -8)) << i;
  // Representable: 8-bit integers times powers of two.
  auto k = rand_int(n, 232, -255, 256);
  auto e = rand_int(n, 233, -20, 20);
  for (int64_t i = 0; i < n; ++i) x[i] = std::ldexp(float(k[i]), e[i]);
  cast(ctx, Tensor(mid.data(), {n}, DType::BF16), view(x, {n}));
  cast(ctx, view(back, {n}), Tensor(mid.data(), {n}, DType::BF16));
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], x[i]) << i;
}

// Exactly halfway between two bf16 (f16) values, the even mantissa wins.
// 1 + 2^-8 lies between bf16 1.0 (mantissa 0) and 1 + 2^-7 (mantissa 1): even is 1.0.
// 1 + 3 * 2^-8 lies between mantissas 1 and 2: even is 1 + 2^-6.
TEST(Cast, TiesRoundToEven) {
  KernelContext ctx;
  std::vector<float> x = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f), 0x1p-100f * (1.0f + 3 * 0x1p-8f)};
  std::vector<float> bf_expect = {1.0f, 1.0f + 0x1p-6f, -1.0f, 0x1p-100f * (1.0f + 0x1p-6f)};
  std::vector<bf16> b(x.size());
  std::vector<float> back(x.size());
  int64_t n = int64_t(x.size());
  cast(ctx, Tensor(b.data(), {n}, DType::BF16), view(x, {n}));
  cast(ctx, view(back, {n}), Tensor(b.data(), {n}, DType::BF16));
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(back[i], bf_expect[i]) << "bf16 tie " << i;
  // f16 has 11 significant bits: ties at 1 + 2^-11 and 1 + 3 * 2^-11.
  std::vector<float> h = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, -(1.0f + 3 * 0x1p-11f)};
  std::vector<float> h_expect = {1.0f, 1.0f + 0x1p-9f, -(1.0f + 0x1p-9f)};
  std::vector<f16> hf(h.size());
  std::vector<float> hback(h.size());
  n = int64_t(h.size());
  cast(ctx, Tensor(hf.data(), {n}, DType::F16), view(h, {n}));
  cast(ctx, view(hback, {n}), Tensor(hf.data(), {n}, DType::F16));
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hback[i], h_expect[i]) << "f16 tie " << i;
}

TEST(Cast, ShapeMismatchNamesTheOp) {
  KernelContext ctx;
  std::vector<float> a(6);
  std::vector<double> b(7);
  expect_error([&] { cast(ctx, view(b, {7}), view(a, {6})); }, ErrorKind::Shape, {"cast"});
}

// ---------------------------------------------------------------- all_finite

// One NaN, +inf or -inf anywhere (first, middle, last element) makes the
// tensor non-finite, in every float dtype; the largest finite values do not.
TEST(AllFinite, DetectsEveryNonFiniteKind) {
  KernelContext ctx;
  const DType types[] = {DType::F32, DType::F64, DType::BF16, DType::F16};
  const double bad[] = {std::numeric_limits<double>::quiet_NaN(), INFINITY, -INFINITY};
  const int64_t n = 301;
  for (DType t : types) {
    SCOPED_TRACE(dtype_name(t));
    Vec v = randn(n, 241, 3.0);
    v[7] = (t == DType::F16 ? 65504.0 : t == DType::BF16 ? 3.3e38 : 3.4e38);  // near the largest finite value
    auto buf = store_as(v, t);
    EXPECT_TRUE(all_finite(ctx, Tensor(buf.data(), {n}, t)));
    for (double b : bad)
      for (int64_t at : {int64_t(0), n / 2, n - 1}) {
        Vec w = v;
        w[at] = b;
        auto wb = store_as(w, t);
        EXPECT_FALSE(all_finite(ctx, Tensor(wb.data(), {n}, t))) << b << " at " << at;
      }
  }
}

}  // namespace
}  // namespace xirang::test
