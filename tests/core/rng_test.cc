// Tests for core/rng.h: Philox-4x32-10 known answers and word mapping,
// determinism, and the statistics of the uniform, normal and bounded draws.
//
// Parameter initialisation is a pure function of (seed, name, index), so a
// change in any of these numbers silently changes every model's init: the
// known answers are the golden numbers that pin it.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/rng.h"

namespace xirang {
namespace {

using Block = std::array<uint32_t, 4>;

// Philox4x32-10 written from Salmon et al. (SC'11) on the paper's 4 counter
// words and 2 key words, independent of core/rng.cc's 64-bit packing:
// round: (c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0));
// the key is bumped by the Weyl constants between rounds.
Block philox_ref(Block c, std::array<uint32_t, 2> k) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) k = {k[0] + 0x9E3779B9u, k[1] + 0xBB67AE85u};
    uint64_t p0 = uint64_t(0xD2511F53u) * c[0], p1 = uint64_t(0xCD9E8D57u) * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1], uint32_t(p0)};
  }
  return c;
}

// Random123's kat_vectors for philox4x32 with 10 rounds.
struct Kat {
  Block ctr;
  std::array<uint32_t, 2> key;
  Block out;
};
const Kat kKats[] = {
    {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

TEST(Philox, ReferenceMatchesPaperVectors) {
  for (auto& k : kKats) EXPECT_EQ(philox_ref(k.ctr, k.key), k.out);
}

// philox4x32(key, hi, lo): counter words c0, c1 = low, high half of
// counter_lo; c2, c3 = low, high half of counter_hi; key words = low, high
// half of key.
Block via_api(const Block& c, const std::array<uint32_t, 2>& k) {
  uint64_t key = uint64_t(k[1]) << 32 | k[0];
  uint64_t lo = uint64_t(c[1]) << 32 | c[0];
  uint64_t hi = uint64_t(c[3]) << 32 | c[2];
  return philox4x32(key, hi, lo);
}

TEST(Philox, KnownAnswers) {
  for (auto& k : kKats) EXPECT_EQ(via_api(k.ctr, k.key), k.out);
}

// The mapping of all six words, on inputs whose words all differ (a swapped
// pair would go unnoticed on the all-zero and all-one vectors).
TEST(Philox, WordMappingMatchesReference) {
  uint64_t s = 0x0123456789abcdefull;
  for (int i = 0; i < 200; ++i) {
    auto next = [&] {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      return uint32_t(s >> 32);
    };
    Block c = {next(), next(), next(), next()};
    std::array<uint32_t, 2> k = {next(), next()};
    ASSERT_EQ(via_api(c, k), philox_ref(c, k)) << "case " << i;
  }
}

TEST(Rng, DeterministicAndSensitiveToEveryInput) {
  EXPECT_EQ(rng_normal(7, 11, 13), rng_normal(7, 11, 13));
  EXPECT_EQ(rng_uniform(7, 11, 13), rng_uniform(7, 11, 13));
  EXPECT_EQ(rng_below(7, 11, 13, 1000), rng_below(7, 11, 13, 1000));
  double base = rng_uniform(7, 11, 13);
  EXPECT_NE(rng_uniform(8, 11, 13), base);
  EXPECT_NE(rng_uniform(7, 12, 13), base);
  EXPECT_NE(rng_uniform(7, 11, 14), base);
}

TEST(Rng, NameStreamIsStableAndDistinct) {
  EXPECT_EQ(name_stream("h.0.attn.c_attn.weight"), name_stream("h.0.attn.c_attn.weight"));
  EXPECT_NE(name_stream("h.0.attn.c_attn.weight"), name_stream("h.1.attn.c_attn.weight"));
  EXPECT_NE(name_stream("a"), name_stream("b"));
  EXPECT_NE(name_stream(""), name_stream("a"));
}

// Uniform draws lie strictly inside (0, 1) (Box-Muller takes log(u)), with
// mean 1/2 and variance 1/12. n = 1e5: the 5-sigma bound on the mean is
// 5 sqrt(1/12 / n) = 4.6e-3; on the variance 5 sqrt(1/180 / n) = 1.2e-3.
TEST(Rng, UniformMoments) {
  const int n = 100000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    double u = rng_uniform(42, 3, uint64_t(i));
    ASSERT_GT(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sq += u * u;
  }
  double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.5, 4.6e-3);
  EXPECT_NEAR(var, 1.0 / 12, 1.2e-3);
}

// Standard normal: mean 0 (sd of the sample mean 1/sqrt(n) = 3.2e-3),
// variance 1 (sd sqrt(2/n) = 4.5e-3), the fraction within one sigma
// 0.6827 (sd sqrt(p(1-p)/n) = 1.5e-3); all checked at 5 sigma, plus the
// third and fourth moments (0 and 3; sd sqrt(15/n) = 0.012, sqrt(96/n) = 0.031).
TEST(Rng, NormalMoments) {
  const int n = 100000;
  double m1 = 0, m2 = 0, m3 = 0, m4 = 0;
  int within = 0;
  for (int i = 0; i < n; ++i) {
    double x = rng_normal(1234, name_stream("w"), uint64_t(i));
    ASSERT_TRUE(std::isfinite(x));
    m1 += x, m2 += x * x, m3 += x * x * x, m4 += x * x * x * x;
    within += std::fabs(x) < 1.0;
  }
  m1 /= n, m2 /= n, m3 /= n, m4 /= n;
  EXPECT_NEAR(m1, 0.0, 5 * 3.2e-3);
  EXPECT_NEAR(m2 - m1 * m1, 1.0, 5 * 4.5e-3);
  EXPECT_NEAR(double(within) / n, 0.682689, 5 * 1.5e-3);
  EXPECT_NEAR(m3, 0.0, 5 * 0.012);
  EXPECT_NEAR(m4, 3.0, 5 * 0.031);
}

// rng_below stays in [0, n) for small, odd, large and 2^40-sized n, and for
// n = 7 hits every value about equally: chi-square with 6 degrees of freedom
// over 7e4 draws stays below 30 (p < 1e-4).
TEST(Rng, BelowRangeAndUniformity) {
  for (uint64_t n : {uint64_t(1), uint64_t(2), uint64_t(7), uint64_t(1000), uint64_t(1) << 40}) {
    uint64_t mx = 0;
    for (uint64_t i = 0; i < 10000; ++i) {
      uint64_t r = rng_below(5, 9, i, n);
      ASSERT_LT(r, n) << "n " << n;
      mx = std::max(mx, r);
    }
    // The largest of 1e4 draws is within the top eighth of the range.
    if (n > 1) {
      EXPECT_GE(mx, n - 1 - n / 8) << "n " << n << ": draws never reach the top of the range";
    }
  }
  std::array<int, 7> counts{};
  const int draws = 70000;
  for (int i = 0; i < draws; ++i) ++counts[rng_below(77, 1, uint64_t(i), 7)];
  double chi2 = 0, expect = draws / 7.0;
  for (int c : counts) chi2 += (c - expect) * (c - expect) / expect;
  EXPECT_LT(chi2, 30.0);
}

}  // namespace
}  // namespace xirang
