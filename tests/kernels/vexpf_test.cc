// cpu::exp8f (kernels/cpu/vexpf.h) against libm in double: within 2 ulp of
// float over [-87.3, 88.3], 0 below, NaN kept, and the same result for a
// value in every lane.
#include "kernels/cpu/vexpf.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace xirang {
namespace {

std::vector<float> exp8f_of(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i + 8 <= x.size(); i += 8) _mm256_storeu_ps(&y[i], cpu::exp8f(_mm256_loadu_ps(&x[i])));
  return y;
}

TEST(VectorExpFloat, WithinTwoUlpOfLibm) {
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<float> wide(-87.3f, 88.3f), near(-20.f, 0.f);
  std::vector<float> x(400000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = i % 2 ? wide(gen) : near(gen);
  const std::vector<float> y = exp8f_of(x);
  double worst_ulp = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(double(x[i]));
    const float wf = float(want);
    if (wf < std::numeric_limits<float>::min()) {
      EXPECT_LE(std::fabs(double(y[i]) - want), 2e-45) << "x = " << x[i];
      continue;
    }
    const double ulp = double(std::nextafter(wf, INFINITY)) - double(wf);
    worst_ulp = std::max(worst_ulp, std::fabs(double(y[i]) - want) / ulp);
  }
  EXPECT_LE(worst_ulp, 2.0);
}

TEST(VectorExpFloat, SpecialValuesAndLanes) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> y = exp8f_of({0.f, -inf, nan, -100.f, -87.4f, 1.f, -1.f, 88.f});
  EXPECT_EQ(y[0], 1.f);
  EXPECT_EQ(y[1], 0.f);
  EXPECT_TRUE(std::isnan(y[2]));
  EXPECT_EQ(y[3], 0.f);
  EXPECT_EQ(y[4], 0.f);
  EXPECT_NEAR(y[5], std::exp(1.0), 3e-7);
  EXPECT_NEAR(y[6], std::exp(-1.0), 1e-7);
  EXPECT_NEAR(y[7] / std::exp(88.0), 1.0, 3e-7);
  for (int lane = 0; lane < 8; ++lane) {
    std::vector<float> x(8, -3.f);
    x[size_t(lane)] = -0.3712f;
    EXPECT_EQ(exp8f_of(x)[size_t(lane)], exp8f_of(std::vector<float>(8, -0.3712f))[0]) << "lane " << lane;
  }
}

}  // namespace
}  // namespace xirang
