// cpu::exp_in_place (kernels/cpu/vexp.h) against libm: within 1 ulp for
// normal results, subnormal results within a subnormal, the special
// values, and the same result for an element wherever it sits in an array
// (a vector lane or the tail). cpu::tanh_floats (kernels/cpu/vtanh.h)
// against libm's double tanh rounded to float.
#include "kernels/cpu/vexp.h"
#include "kernels/cpu/vtanh.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace xirang {
namespace {

TEST(VectorExp, WithinOneUlpOfLibm) {
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> wide(-760.0, 712.0), near(-40.0, 0.0);
  std::vector<double> x(200000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = i % 2 ? wide(gen) : near(gen);
  std::vector<double> y = x;
  cpu::exp_in_place(y.data(), int64_t(y.size()));
  double worst_ulp = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(x[i]);
    if (want >= std::numeric_limits<double>::min() && std::isfinite(want)) {
      const double ulp = std::nextafter(want, INFINITY) - want;
      worst_ulp = std::max(worst_ulp, std::fabs(y[i] - want) / ulp);
    } else if (std::isinf(want)) {
      EXPECT_TRUE(std::isinf(y[i])) << "x = " << x[i];
    } else {
      EXPECT_LE(std::fabs(y[i] - want), 1e-320) << "x = " << x[i];  // subnormal or zero
    }
  }
  EXPECT_LE(worst_ulp, 1.0);
}

TEST(VectorExp, SpecialValues) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> x = {0.0, -0.0, 1.0, -1.0, std::nan(""), -inf, inf, -1e6, 1e6, 709.78, -745.2};
  cpu::exp_in_place(x.data(), int64_t(x.size()));
  EXPECT_EQ(x[0], 1.0);
  EXPECT_EQ(x[1], 1.0);
  EXPECT_NEAR(x[2], std::exp(1.0), 4.5e-16);  // 1 ulp
  EXPECT_NEAR(x[3], std::exp(-1.0), 1e-16);
  EXPECT_TRUE(std::isnan(x[4]));
  EXPECT_EQ(x[5], 0.0);
  EXPECT_TRUE(std::isinf(x[6]));
  EXPECT_EQ(x[7], 0.0);
  EXPECT_TRUE(std::isinf(x[8]));
  EXPECT_TRUE(std::isfinite(x[9]));
  EXPECT_LE(x[10], 1e-323);
}

// Every element's result is its own: the same whether it is computed in a
// vector lane or in the tail of an array of any length.
TEST(VectorExp, ResultDoesNotDependOnThePosition) {
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<double> u(-30.0, 5.0);
  std::vector<double> base(13);
  for (double& v : base) v = u(gen);
  std::vector<double> each(base.size());
  for (size_t i = 0; i < base.size(); ++i) {
    double one = base[i];
    cpu::exp_in_place(&one, 1);
    each[i] = one;
  }
  for (size_t n = 1; n <= base.size(); ++n)
    for (size_t off = 0; off + n <= base.size(); ++off) {
      std::vector<double> y(base.begin() + long(off), base.begin() + long(off + n));
      cpu::exp_in_place(y.data(), int64_t(n));
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(y[i], each[off + i]) << "n " << n << " offset " << off;
    }
}

// Within 1 float ulp of the double tanh rounded to float, from tiny inputs
// (the series) through the switch at 1/8 to saturation, both signs.
TEST(VectorTanh, WithinOneUlpOfTheRoundedDoubleTanh) {
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<double> expo(-40.0, 4.0), lin(-10.0, 10.0), sw(0.1, 0.15);
  std::vector<float> u(300000);
  for (size_t i = 0; i < u.size(); ++i) {
    const double sign = gen() % 2 ? 1.0 : -1.0;
    u[i] = float(i % 3 == 0 ? sign * std::exp2(expo(gen)) : i % 3 == 1 ? lin(gen) : sign * sw(gen));
  }
  std::vector<float> t(u.size());
  std::vector<double> scratch(u.size());
  cpu::tanh_floats(u.data(), t.data(), int64_t(u.size()), scratch.data());
  int64_t exact = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    const float want = float(std::tanh(double(u[i])));
    exact += t[i] == want;
    const float ulp = std::nextafter(std::fabs(want), INFINITY) - std::fabs(want);
    ASSERT_LE(std::fabs(t[i] - want), ulp) << "u = " << u[i] << ": " << t[i] << " vs " << want;
  }
  EXPECT_GE(double(exact), 0.9999 * double(u.size()));  // off only in near-ties
}

TEST(VectorTanh, SpecialValuesAndAliasing) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> u = {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 40.0f, -1e30f, 1e-40f};
  std::vector<double> scratch(u.size());
  cpu::tanh_floats(u.data(), u.data(), int64_t(u.size()), scratch.data());  // in place
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_TRUE(std::signbit(u[1]));
  EXPECT_EQ(u[1], 0.0f);
  EXPECT_EQ(u[2], 1.0f);
  EXPECT_EQ(u[3], -1.0f);
  EXPECT_TRUE(std::isnan(u[4]));
  EXPECT_EQ(u[5], 1.0f);
  EXPECT_EQ(u[6], -1.0f);
  EXPECT_EQ(u[7], 1e-40f);  // subnormal: tanh(u) = u
}

}  // namespace
}  // namespace xirang
