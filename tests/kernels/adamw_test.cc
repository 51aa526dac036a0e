// Tests for kernels/adamw.h against the float64 reference, over several
// steps with weight decay and a gradient scale != 1, and the 16-bit (or F32)
// model copy written in the same pass.
//
// fp32 tolerance: 1e-5 of max(1, max|ref|). The update is elementwise (no
// reductions): about 15 fp32 roundings per element per step, over 5 steps,
// plus the bias corrections 1 - beta^t computed in float or double. The
// state stays ~1e-6 relative to the reference; the parameter change per
// step is lr * O(1) = 1e-2, so a wrong formula (no bias correction, decay
// on the wrong term, scale applied twice) moves p by >= 1e-4.
#include <cmath>
#include <cstring>

#include <omp.h>

#include "kernels/adamw.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;
constexpr int64_t kRows = 37, kCols = 48;

template <class T>
class AdamWTest : public ::testing::Test {};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AdamWTest, ComputeTypes);

AdamWStep make_step(int64_t t) {
  AdamWStep s;
  s.lr = 1e-2;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  s.step = t;
  s.grad_scale = 0.37;
  return s;
}
AdamWRef as_ref(const AdamWStep& s) {
  return {s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.grad_scale};
}

// Master and state of type T, gradient of type G (same as T, or bf16 read
// through float); steps t0 .. t0 + 4 with a fresh gradient each step.
template <class T, class G>
void run_steps(int64_t t0, bool zero_state, uint64_t seed) {
  KernelContext ctx;
  const int64_t n = kRows * kCols;
  auto p = cast_vec<T>(randn(n, seed, 0.5));
  // A resumed run has m of either sign and v > 0; a fresh one starts at zero
  // (the only place zeros are the realistic input).
  auto m = cast_vec<T>(zero_state ? Vec(n, 0.0) : randn(n, seed + 1, 0.1));
  Vec vv = randn(n, seed + 2, 0.1);
  for (double& x : vv) x = zero_state ? 0.0 : x * x;
  auto v = cast_vec<T>(vv);
  Vec rp = to_f64(p), rm = to_f64(m), rv = to_f64(v);
  for (int64_t t = t0; t < t0 + 5; ++t) {
    SCOPED_TRACE(testing::Message() << "step " << t);
    // Gradients of scale 1 with a few large ones (x 30), as before clipping.
    Vec g = randn(n, seed + 10 + uint64_t(t));
    for (int64_t i = 0; i < n; i += 97) g[i] *= 30.0;
    std::vector<G> gs(n);
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<G, bf16>) gs[i] = float_to_bf16(float(g[i]));
      else gs[i] = G(g[i]);
    }
    Vec gr(n);  // the gradient values the kernel reads
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<G, bf16>) gr[i] = bf16_to_float(gs[i]);
      else gr[i] = double(gs[i]);
    }
    AdamWStep s = make_step(t);
    adamw_update(ctx, view(p, {kRows, kCols}), Tensor(gs.data(), {kRows, kCols}, dtype_of<G>::value),
                 view(m, {kRows, kCols}), view(v, {kRows, kCols}), s);
    ref_adamw(rp, rm, rv, gr, as_ref(s), t);
    expect_near(p, rp, tol<T>(kTolF32), "param");
    expect_near(m, rm, tol<T>(kTolF32), "m");
    // v is O(1e-1 .. 1e1) with a few large entries; compare at its own scale.
    expect_near(v, rv, tol<T>(kTolF32), "v");
    if (::testing::Test::HasFailure()) return;  // later steps only repeat the first difference
  }
}

TYPED_TEST(AdamWTest, FiveStepsFromZeroState) { run_steps<TypeParam, TypeParam>(1, true, 601); }

// Resumed at step 7 with non-zero moments: bias corrections at t > 1 and
// the decay of existing m, v are exercised.
TYPED_TEST(AdamWTest, FiveStepsResumed) { run_steps<TypeParam, TypeParam>(7, false, 611); }

// Mixed precision: fp32 master weights, bf16 gradients read through float.
TEST(AdamWMixed, Bf16GradientsIntoF32Master) { run_steps<float, bf16>(3, false, 621); }

// With beta1 = beta2 = 0 and no decay one step moves every parameter by
// lr * g / (|g| + eps) = lr * sign(g): a closed form that does not need the
// reference at all.
TEST(AdamWClosedForm, ZeroBetasGiveSignUpdate) {
  KernelContext ctx;
  const int64_t n = 301;
  Vec p = randn(n, 631), g = randn(n, 632), m = randn(n, 633), v = randu(n, 634, 0.1, 1.0);
  Vec p0 = p;
  AdamWStep s;
  s.lr = 0.05;
  s.beta1 = 0;
  s.beta2 = 0;
  s.eps = 1e-12;
  s.weight_decay = 0;
  s.step = 1;
  s.grad_scale = 3.0;
  adamw_update(ctx, view(p, {n}), view(g, {n}), view(m, {n}), view(v, {n}), s);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], p0[i] - 0.05 * (g[i] > 0 ? 1.0 : -1.0), 1e-10) << i;
    ASSERT_NEAR(m[i], 3.0 * g[i], 1e-12) << i;
    ASSERT_NEAR(v[i], 9.0 * g[i] * g[i], 1e-11 * (1 + v[i])) << i;
  }
}

// ---------------------------------------------------------------- bitwise

// The update as one scalar expression per element, in the order the kernel
// has always used (the compiler contracts nothing: the build is ISO C++,
// -ffp-contract=off). The vectorized kernel must give these bits exactly,
// for every gradient type, so fp32 training runs do not change.
template <class T>
void scalar_adamw(std::vector<T>& p, const Vec& g, std::vector<T>& m, std::vector<T>& v, const AdamWStep& s) {
  const double c1 = 1.0 - std::pow(s.beta1, double(s.step));
  const double c2 = 1.0 - std::pow(s.beta2, double(s.step));
  const T b1 = T(s.beta1), b2 = T(s.beta2), lr = T(s.lr), eps = T(s.eps), wd = T(s.weight_decay);
  const T gs = T(s.grad_scale), ic1 = T(1.0 / c1), ic2 = T(1.0 / c2);
  for (size_t i = 0; i < p.size(); ++i) {
    T gi = T(g[i]) * gs;
    T mi = b1 * m[i] + (T(1) - b1) * gi;
    T vi = b2 * v[i] + (T(1) - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    T update = (mi * ic1) / (std::sqrt(vi * ic2) + eps) + wd * p[i];
    p[i] -= lr * update;
  }
}

// Master type T, gradient storage G; several blocks plus a ragged tail, with
// 1 and 3 threads; with a 16-bit copy, the copy is checked too.
template <class T, class G>
void expect_bitwise(uint64_t seed, DType copy_type = DType::F64) {
  KernelContext ctx;
  const int64_t n = 3 * 2048 + 77;
  const auto p0 = cast_vec<T>(randn(n, seed, 0.5)), m0 = cast_vec<T>(randn(n, seed + 1, 0.1));
  Vec vv = randn(n, seed + 2, 0.1);
  for (double& x : vv) x *= x;
  const auto v0 = cast_vec<T>(vv);
  Vec g = randn(n, seed + 3);
  for (int64_t i = 0; i < n; i += 89) g[i] *= 30.0;
  const auto gs = cast_vec<G>(g);
  const Vec gr = to_f64(gs);  // the values the kernel reads
  AdamWStep s = make_step(4);
  s.weight_decay = 0.1;
  auto rp = p0, rm = m0, rv = v0;
  scalar_adamw(rp, gr, rm, rv, s);
  for (int threads : {1, 3}) {
    SCOPED_TRACE(testing::Message() << threads << " threads");
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    auto p = p0, m = m0, v = v0;
    std::vector<uint16_t> copy(size_t(n), 0xA5A5);
    Tensor copy_t = copy_type == DType::F64 ? Tensor() : Tensor(copy.data(), {n}, copy_type);
    adamw_update(ctx, view(p, {n}), Tensor(const_cast<G*>(gs.data()), {n}, dtype_of<G>::value), view(m, {n}),
                 view(v, {n}), s, copy_t);
    omp_set_num_threads(saved);
    EXPECT_EQ(0, std::memcmp(p.data(), rp.data(), sizeof(T) * size_t(n))) << "param";
    EXPECT_EQ(0, std::memcmp(m.data(), rm.data(), sizeof(T) * size_t(n))) << "m";
    EXPECT_EQ(0, std::memcmp(v.data(), rv.data(), sizeof(T) * size_t(n))) << "v";
    if constexpr (std::is_same_v<T, float>)
      if (copy_type != DType::F64) {
        int bad = 0;
        for (int64_t i = 0; i < n && bad < 5; ++i) {
          const uint16_t want = copy_type == DType::BF16 ? float_to_bf16(rp[i]).bits : float_to_f16(rp[i]).bits;
          if (copy[i] != want) ++bad, ADD_FAILURE() << "copy[" << i << "] = " << copy[i] << ", expected " << want;
        }
      }
  }
}

TEST(AdamWBitwise, F32GradientsMatchTheScalarFormula) { expect_bitwise<float, float>(661); }
TEST(AdamWBitwise, Bf16GradientsMatchTheScalarFormula) { expect_bitwise<float, bf16>(662); }
TEST(AdamWBitwise, F16GradientsMatchTheScalarFormula) { expect_bitwise<float, f16>(663); }
TEST(AdamWBitwise, F64MatchesTheScalarFormula) { expect_bitwise<double, double>(664); }
TEST(AdamWBitwise, F32GradientsIntoF64Master) { expect_bitwise<double, float>(665); }
TEST(AdamWBitwise, Bf16CopyAcrossBlocks) { expect_bitwise<float, float>(666, DType::BF16); }
TEST(AdamWBitwise, F16CopyAcrossBlocks) { expect_bitwise<float, float>(667, DType::F16); }

// ---------------------------------------------------------------- model copy

// The stored value a model copy of dtype t must hold for master value x:
// round to nearest even at t's precision (reference.h's rounding, not
// core/dtype's conversions).
double ref_copy_value(double x, DType t) {
  switch (t) {
    case DType::BF16: return ref_round_bf16(x);
    case DType::F16: return ref_round_f16(x);
    default: return double(float(x));
  }
}

double read_copy(const std::vector<uint8_t>& buf, size_t i, DType t) {
  switch (t) {
    case DType::BF16: { bf16 x; std::memcpy(&x, &buf[i * 2], 2); return bf16_to_float(x); }
    case DType::F16: { f16 x; std::memcpy(&x, &buf[i * 2], 2); return f16_to_float(x); }
    default: { float x; std::memcpy(&x, &buf[i * 4], 4); return x; }
  }
}

// With model_copy defined, the F32 master, m and v are updated exactly as
// without it (bitwise), and the copy holds each updated master value rounded
// once to its dtype (bitwise: a conversion is one correctly rounded
// operation). Masters lie in +-[2^-6, 2^2], inside f16's normal range, and
// the copy buffer starts as garbage, so an element left unwritten shows.
TEST(AdamWModelCopy, CopyIsTheRoundedUpdatedMaster) {
  KernelContext ctx;
  const int64_t n = kRows * kCols;
  Vec mag = randu(n, 641, -6.0, 2.0), sign = randn(n, 642);
  Vec p0(n);
  for (int64_t i = 0; i < n; ++i) p0[i] = std::copysign(std::exp2(mag[i]), sign[i]);
  const auto g = cast_vec<bf16>(randn(n, 643));
  const auto m0 = cast_vec<float>(randn(n, 644, 0.1));
  Vec vv = randn(n, 645, 0.1);
  for (double& x : vv) x *= x;
  const auto v0 = cast_vec<float>(vv);
  for (int64_t step : {int64_t(1), int64_t(9)}) {
    // The update without a copy, for comparison.
    auto p_plain = cast_vec<float>(p0), m_plain = m0, v_plain = v0;
    adamw_update(ctx, view(p_plain, {n}), Tensor(const_cast<bf16*>(g.data()), {n}, DType::BF16), view(m_plain, {n}),
                 view(v_plain, {n}), make_step(step));
    for (DType t : {DType::BF16, DType::F16, DType::F32}) {
      SCOPED_TRACE(testing::Message() << dtype_name(t) << " copy, step " << step);
      auto p = cast_vec<float>(p0), m = m0, v = v0;
      std::vector<uint8_t> copy(size_t(n) * dtype_size(t), 0xA5);
      adamw_update(ctx, view(p, {kRows, kCols}), Tensor(const_cast<bf16*>(g.data()), {kRows, kCols}, DType::BF16),
                   view(m, {kRows, kCols}), view(v, {kRows, kCols}), make_step(step),
                   Tensor(copy.data(), {kRows, kCols}, t));
      EXPECT_EQ(p, p_plain) << "master";
      EXPECT_EQ(m, m_plain) << "m";
      EXPECT_EQ(v, v_plain) << "v";
      int bad = 0;
      for (int64_t i = 0; i < n && bad < 5; ++i)
        if (read_copy(copy, size_t(i), t) != ref_copy_value(p[i], t))
          ++bad, ADD_FAILURE() << "copy[" << i << "] = " << read_copy(copy, size_t(i), t) << " for master " << p[i]
                               << ", expected " << ref_copy_value(p[i], t);
    }
  }
}

// The copy may alias the F32 master itself (a model that computes in F32
// with the master as its weights): the update is then unchanged.
TEST(AdamWModelCopy, F32CopyAliasingTheMaster) {
  KernelContext ctx;
  const int64_t n = 301;
  auto p = cast_vec<float>(randn(n, 651)), g = cast_vec<float>(randn(n, 652));
  auto m = cast_vec<float>(randn(n, 653, 0.1)), v = cast_vec<float>(randu(n, 654, 0.01, 0.1));
  auto p2 = p, m2 = m, v2 = v;
  adamw_update(ctx, view(p, {n}), view(g, {n}), view(m, {n}), view(v, {n}), make_step(2), view(p, {n}));
  adamw_update(ctx, view(p2, {n}), view(g, {n}), view(m2, {n}), view(v2, {n}), make_step(2));
  EXPECT_EQ(p, p2);
}

TEST(AdamWModelCopy, RejectsWrongCopies) {
  KernelContext ctx;
  std::vector<float> p(12), g(12), m(12), v(12);
  std::vector<bf16> copy11(11), copy12(12);
  std::vector<double> copy64(12), p64(12), g64(12), m64(12), v64(12);
  expect_error([&] {
    adamw_update(ctx, view(p, {12}), view(g, {12}), view(m, {12}), view(v, {12}), make_step(1), view(copy11, {11}));
  }, ErrorKind::Shape, {"adamw_update", "model_copy"});
  expect_error([&] {
    adamw_update(ctx, view(p, {12}), view(g, {12}), view(m, {12}), view(v, {12}), make_step(1), view(copy64, {12}));
  }, ErrorKind::Shape, {"adamw_update", "model_copy"});
  // A 16-bit copy is made from an F32 master, not an F64 one.
  expect_error([&] {
    adamw_update(ctx, view(p64, {12}), view(g64, {12}), view(m64, {12}), view(v64, {12}), make_step(1),
                 view(copy12, {12}));
  }, ErrorKind::Shape, {"adamw_update", "f32 master"});
}

TEST(AdamWErrors, GradShapeMismatchNamesTheOp) {
  KernelContext ctx;
  std::vector<float> p(12), g(13), m(12), v(12);
  expect_error([&] { adamw_update(ctx, view(p, {12}), view(g, {13}), view(m, {12}), view(v, {12}), make_step(1)); },
               ErrorKind::Shape, {"adamw"});
}

TEST(AdamWErrors, StateDtypeMismatchNamesTheOp) {
  KernelContext ctx;
  std::vector<float> p(12), g(12), m(12);
  std::vector<double> v(12);
  expect_error([&] { adamw_update(ctx, view(p, {12}), view(g, {12}), view(m, {12}), view(v, {12}), make_step(1)); },
               ErrorKind::Shape, {"adamw"});
}

}  // namespace
}  // namespace xirang::test
