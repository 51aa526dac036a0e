// Tests for kernels/elementwise.h: GELU forward/backward (with a
// finite-difference check), add_bias, add, scale, zero, casts between every
// pair of float dtypes, sum_squares and all_finite.
//
// The per-element ops run as one typed suite over f64, f32, bf16 and f16
// (storage_types.h); 16-bit inputs are rounded to the type first and the
// float64 reference reads those values. Tolerances, relative to
// max(1, max|ref|) (ElementwiseTol below):
// - f32 GELU: 1e-5. Each element is a handful of fp32 operations plus tanh
//   (a few ulp); the derivative's 1 - tanh^2 cancels for |x| ~ 4, where its
//   absolute error reaches ~5e-7.
// - f32 add, add_bias, scale: one fp32 rounding (6e-8, scale's factor may be
//   rounded to float first: two), 2.5e-7 with margin.
// - f64: 1e-10, only the order of operations differs from the reference.
// - 16-bit: each output is computed in float from exact 16-bit inputs (GELU
//   ~1e-7 relative; the adds are exact in float for these magnitudes) and
//   rounded once, so it is within u |y| of the reference, u = 2^-8 (bf16) or
//   2^-11 (f16). The tolerance is 2u, and >= 97% of the GELU elements (99%
//   for the exact adds) must equal the reference rounded once; an op that
//   rounded an intermediate (x^3, tanh) to 16 bits would miss both. The long
//   GELU test bounds each element on its own scale: the f32 bound plus one
//   rounding, 1e-5 + u.
// - sum_squares accumulates the exact squares in double for every type:
//   1e-12 relative.
#include <cmath>
#include <cstring>
#include <limits>

#include <omp.h>

#include "core/dtype.h"
#include "kernels/elementwise.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

template <class T>
struct ElementwiseTol {
  static constexpr double gelu = stored_tol<T>(1e-5, 2);
  static constexpr double gelu_per_element = is_16bit_v<T> ? 1e-5 + unit_roundoff<T>() : tol<T>(1e-5);
  static constexpr double one_rounding = stored_tol<T>(2.5e-7, 2);
  static constexpr double gelu_rounded = 0.97, add_rounded = 0.99;  // 16-bit: fraction rounded once
};

template <class T>
class ElementwiseTest : public ::testing::Test {
 protected:
  using Tol = ElementwiseTol<T>;
  static constexpr int64_t N = 37, C = 48;
  KernelContext ctx;
  // Scale 2 covers the tails where tanh saturates as well as the centre.
  std::vector<T> x = cast_vec<T>(randn(N * C, 201, 2.0));
  std::vector<T> dy = cast_vec<T>(randn(N * C, 202));
  Vec gelu_grad_reference() const {
    Vec xr = to_f64(x), dyr = to_f64(dy), ref(xr.size());
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = dyr[i] * ref_gelu_grad(xr[i]);
    return ref;
  }
};
TYPED_TEST_SUITE(ElementwiseTest, StorageTypes, StorageTypeNames);

TYPED_TEST(ElementwiseTest, GeluForward) {
  using T = TypeParam;
  auto& f = *this;
  auto y = cast_vec<T>(randn(f.N * f.C, 203));
  gelu_forward(f.ctx, view(y, {f.N, f.C}), view(f.x, {f.N, f.C}));
  Vec xr = to_f64(f.x), ref(xr.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = ref_gelu(xr[i]);
  expect_stored(y, ref, TestFixture::Tol::gelu, TestFixture::Tol::gelu_rounded, "gelu y");
}

// Out of place, then in place (dx over dy, as the MLP backward does): the
// same bytes.
TYPED_TEST(ElementwiseTest, GeluBackward) {
  using T = TypeParam;
  auto& f = *this;
  const Vec ref = f.gelu_grad_reference();
  auto dx = cast_vec<T>(randn(f.N * f.C, 204));
  gelu_backward(f.ctx, view(dx, {f.N, f.C}), view(f.dy, {f.N, f.C}), view(f.x, {f.N, f.C}));
  expect_stored(dx, ref, TestFixture::Tol::gelu, TestFixture::Tol::gelu_rounded, "gelu dx");
  Tensor d = view(f.dy, {f.N, f.C});
  gelu_backward(f.ctx, d, d, view(f.x, {f.N, f.C}));
  EXPECT_EQ(bytes_of(f.dy), bytes_of(dx)) << "in place differs from out of place";
}

// The MLP backward writes dx over dy in place; the header allows it.
TYPED_TEST(ElementwiseTest, GeluBackwardInPlace) {
  auto& f = *this;
  const Vec ref = f.gelu_grad_reference();
  Tensor d = view(f.dy, {f.N, f.C});
  gelu_backward(f.ctx, d, d, view(f.x, {f.N, f.C}));
  expect_near(f.dy, ref, TestFixture::Tol::gelu, "gelu dx aliasing dy");
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


// out = a + b, also with out aliasing a and b (the residual stream adds in
// place): the same bytes as out of place.
TYPED_TEST(ElementwiseTest, AddIncludingAliases) {
  using T = TypeParam;
  auto& f = *this;
  Vec ref = plus(to_f64(f.x), to_f64(f.dy));
  auto out = cast_vec<T>(randn(f.N * f.C, 205));
  add(f.ctx, view(out, {f.N, f.C}), view(f.x, {f.N, f.C}), view(f.dy, {f.N, f.C}));
  expect_stored(out, ref, TestFixture::Tol::one_rounding, TestFixture::Tol::add_rounded, "add");
  auto a = f.x, b = f.dy;
  add(f.ctx, view(a, {f.N, f.C}), view(a, {f.N, f.C}), view(b, {f.N, f.C}));
  EXPECT_EQ(bytes_of(a), bytes_of(out)) << "add out=a";
  a = f.x;
  add(f.ctx, view(b, {f.N, f.C}), view(a, {f.N, f.C}), view(b, {f.N, f.C}));
  EXPECT_EQ(bytes_of(b), bytes_of(out)) << "add out=b";
}

// y += bias on every row, over random prior y; also on a (B, T, C) view,
// whose leading dims are rows.
TYPED_TEST(ElementwiseTest, AddBias) {
  using T = TypeParam;
  auto& f = *this;
  auto bias = cast_vec<T>(randn(f.C, 206));
  Vec ref = ref_add_bias(to_f64(f.x), to_f64(bias), f.N, f.C);
  auto y = f.x;
  add_bias(f.ctx, view(y, {f.N, f.C}), view(bias, {f.C}));
  expect_stored(y, ref, TestFixture::Tol::one_rounding, TestFixture::Tol::add_rounded, "add_bias");
  std::vector<T> y3(2 * 5 * f.C);
  std::copy(f.x.begin(), f.x.begin() + y3.size(), y3.begin());
  add_bias(f.ctx, view(y3, {2, 5, f.C}), view(bias, {f.C}));
  expect_near(y3, Vec(ref.begin(), ref.begin() + y3.size()), TestFixture::Tol::one_rounding, "add_bias on (B, T, C)");
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
  auto& f = *this;
  const double s = -0.3719;
  Vec ref = to_f64(f.x);
  for (double& r : ref) r *= s;
  scale(f.ctx, view(f.x, {f.N, f.C}), s);
  expect_stored(f.x, ref, TestFixture::Tol::one_rounding, TestFixture::Tol::add_rounded, "scale");
  zero(f.ctx, view(f.x, {f.N, f.C}));
  for (size_t i = 0; i < f.x.size(); ++i) ASSERT_EQ(as_double(f.x[i]), 0.0) << "zero left element " << i;
}

// sum_squares accumulates in double, so every storage type gives the
// float64 sum of its stored values to ~1e-12 (n = 1776 terms); for 16-bit
// that is the optimizer's global norm over bf16 gradients.
TYPED_TEST(ElementwiseTest, SumSquares) {
  auto& f = *this;
  double ref = ref_sum_squares(to_f64(f.x));
  EXPECT_NEAR(sum_squares(f.ctx, view(f.x, {f.N, f.C})), ref, 1e-12 * ref);
}

// GELU runs in blocks: several blocks and a ragged tail against the float64
// reference, each element on its own scale, and the same bits for 1 and 3
// threads.
TYPED_TEST(ElementwiseTest, GeluLongAcrossBlocks) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t n = 3 * 512 + 37;
  auto x = cast_vec<T>(randn(n, 209, 3.0)), dy = cast_vec<T>(randn(n, 210));
  const Vec xr = to_f64(x), dyr = to_f64(dy);
  Vec yref(n), dref(n);
  for (int64_t i = 0; i < n; ++i) {
    yref[i] = ref_gelu(xr[i]);
    dref[i] = dyr[i] * ref_gelu_grad(xr[i]);
  }
  const double tol_rel = TestFixture::Tol::gelu_per_element;
  const int saved = omp_get_max_threads();
  std::vector<std::vector<T>> ys, dxs;
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    std::vector<T> y(n), dx(n);
    gelu_forward(f.ctx, view(y, {n}), view(x, {n}));
    gelu_backward(f.ctx, view(dx, {n}), view(dy, {n}), view(x, {n}));
    ys.push_back(y);
    dxs.push_back(dx);
  }
  omp_set_num_threads(saved);
  const Vec y = to_f64(ys[0]), dx = to_f64(dxs[0]);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(y[i], yref[i], tol_rel * std::max(1.0, std::fabs(yref[i]))) << "gelu y " << i << " x " << xr[i];
    ASSERT_NEAR(dx[i], dref[i], tol_rel * std::max(1.0, std::fabs(dref[i]))) << "gelu dx " << i << " x " << xr[i];
  }
  EXPECT_EQ(bytes_of(ys[0]), bytes_of(ys[1])) << "y differs with 3 threads";
  EXPECT_EQ(bytes_of(dxs[0]), bytes_of(dxs[1])) << "dx differs with 3 threads";
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
// cast() from f64 rounds once: a double just above a bf16 tie (by 2^-40,
// far below float's precision) must round up, where rounding to float first
// would land on the tie and round to even (down).
TEST(Cast, DoubleTo16BitRoundsOnce) {
  KernelContext ctx;
  std::vector<double> in = {1.0 + 0x1p-8 + 0x1p-40, -(1.0 + 0x1p-8 + 0x1p-40), 1.0 + 0x1p-11 + 0x1p-40};
  std::vector<bf16> out(2);
  cast(ctx, Tensor(out.data(), {2}, DType::BF16), Tensor(in.data(), {2}, DType::F64));
  EXPECT_EQ(bf16_to_float(out[0]), 1.0f + 0x1p-7f);
  EXPECT_EQ(bf16_to_float(out[1]), -(1.0f + 0x1p-7f));
  std::vector<f16> h(1);
  cast(ctx, Tensor(h.data(), {1}, DType::F16), Tensor(in.data() + 2, {1}, DType::F64));
  EXPECT_EQ(f16_to_float(h[0]), 1.0f + 0x1p-10f);
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
