// Tests for grouped-query attention in the flash pair of kernels/attention.h
// (n_head query heads sharing n_kv_head key/value heads), on the CPU.
//
// The reference is written here from the definition: copy each key/value
// head to the H / KV query heads that use it (query head h reads key/value
// head h / (H / KV)), run plain float64 softmax attention on that multi-head
// qkv (reference.h), and fold the gradients back: dk and dv of a key/value
// head are the sums over its query heads.
//
// Tolerances (relative to the largest reference element, as expect_near):
// - F64: the kernel and the reference compute the same sums in another order
//   (lse and delta = dO . O instead of sum_j p_j dP_j): 1e-12.
// - F32: 1e-5, the multi-head flash test's bound (D <= 16 term dot products,
//   softmax over <= 13 entries); the group sum of dk and dv adds at most 8
//   float-accurate terms in double, one more rounding of the sum.
// - lse: max + log of a double sum, one fp32 rounding of an O(1) number plus
//   fp32 scores: 1e-5 absolute.
// - 16-bit (u = 2^-8 bf16, 2^-11 f16): out 2u as for multi-head. dqkv: each
//   query head's dk, dv carry the multi-head error (a few u of its scale,
//   from the stored out in delta = dO . O); they are summed in double and
//   rounded once, and errors of independent heads do not line up, so the sum
//   stays within 4u of the sum's scale.
#include <omp.h>

#include <array>
#include <cstring>
#include <tuple>
#include <string>

#include "kernels/attention.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

struct GqaShape {
  int64_t B, T, H, KV, D;
  int64_t C() const { return H * D; }             // out's width
  int64_t W() const { return (H + 2 * KV) * D; }  // qkv's width
  std::string str() const {
    return "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) + " KV " +
           std::to_string(KV) + " D " + std::to_string(D);
  }
};

// The multi-head qkv (B, T, 3 H D) in which query head h sees copies of key/value head h / (H / KV).
Vec expand_kv(const Vec& qkv, const GqaShape& a) {
  const int64_t C = a.C(), W = a.W(), G = a.H / a.KV;
  Vec r(a.B * a.T * 3 * C);
  for (int64_t bt = 0; bt < a.B * a.T; ++bt) {
    const double* src = &qkv[bt * W];
    double* dst = &r[bt * 3 * C];
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t g = h / G;
      for (int64_t d = 0; d < a.D; ++d) {
        dst[h * a.D + d] = src[h * a.D + d];
        dst[C + h * a.D + d] = src[C + g * a.D + d];
        dst[2 * C + h * a.D + d] = src[C + (a.KV + g) * a.D + d];
      }
    }
  }
  return r;
}

// A multi-head gradient (B, T, 3 H D) folded into the grouped layout: dq as
// is, dk and dv of key/value head g summed over its query heads.
Vec fold_grads(const Vec& d3, const GqaShape& a) {
  const int64_t C = a.C(), W = a.W(), G = a.H / a.KV;
  Vec r(a.B * a.T * W, 0.0);
  for (int64_t bt = 0; bt < a.B * a.T; ++bt) {
    const double* src = &d3[bt * 3 * C];
    double* dst = &r[bt * W];
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t g = h / G;
      for (int64_t d = 0; d < a.D; ++d) {
        dst[h * a.D + d] = src[h * a.D + d];
        dst[C + g * a.D + d] += src[C + h * a.D + d];
        dst[C + (a.KV + g) * a.D + d] += src[2 * C + h * a.D + d];
      }
    }
  }
  return r;
}

struct GqaRef {
  Vec out, lse, dqkv;  // (B, T, C), (B, H, T), (B, T, W)
};

GqaRef ref_gqa(const Vec& qkv, const Vec& dout, const GqaShape& a) {
  const Vec q3 = expand_kv(qkv, a);
  const int64_t C = a.C();
  GqaRef r{ref_attention_forward(q3, a.B, a.T, C, a.H).out, Vec(a.B * a.H * a.T),
           fold_grads(ref_attention_backward(dout, q3, a.B, a.T, C, a.H), a)};
  const double scale = 1.0 / std::sqrt(double(a.D));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.H; ++h)
      for (int64_t t = 0; t < a.T; ++t) {
        Vec s(t + 1);
        double mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < a.D; ++d)
            dot += q3[(b * a.T + t) * 3 * C + h * a.D + d] * q3[(b * a.T + j) * 3 * C + C + h * a.D + d];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (double v : s) z += std::exp(v - mx);
        r.lse[(b * a.H + h) * a.T + t] = mx + std::log(z);
      }
  return r;
}

template <class S, class St>
struct Run {
  std::vector<S> out, dqkv;
  std::vector<St> lse;
};

// Flash forward then backward with n_kv_head = kv (0: the default argument),
// into outputs pre-filled with random values.
template <class S, class St = std::conditional_t<is_16bit_v<S>, float, S>>
Run<S, St> run(const std::vector<S>& qkv_in, const std::vector<S>& dout_in, const GqaShape& a, int64_t kv_arg,
               int64_t width) {
  KernelContext ctx;
  auto qkv = qkv_in, dout = dout_in;
  const int64_t C = a.C();
  Run<S, St> r{cast_vec<S>(randn(a.B * a.T * C, 1601)), cast_vec<S>(randn(a.B * a.T * width, 1602)),
               cast_vec<St>(randn(a.B * a.H * a.T, 1603))};
  if (kv_arg == 0) {
    flash_attention_forward(ctx, view(r.out, {a.B, a.T, C}), view(r.lse, {a.B, a.H, a.T}),
                            view(qkv, {a.B, a.T, width}), int(a.H));
    flash_attention_backward(ctx, view(r.dqkv, {a.B, a.T, width}), view(dout, {a.B, a.T, C}),
                             view(qkv, {a.B, a.T, width}), view(r.out, {a.B, a.T, C}), view(r.lse, {a.B, a.H, a.T}),
                             int(a.H));
  } else {
    flash_attention_forward(ctx, view(r.out, {a.B, a.T, C}), view(r.lse, {a.B, a.H, a.T}),
                            view(qkv, {a.B, a.T, width}), int(a.H), int(kv_arg));
    flash_attention_backward(ctx, view(r.dqkv, {a.B, a.T, width}), view(dout, {a.B, a.T, C}),
                             view(qkv, {a.B, a.T, width}), view(r.out, {a.B, a.T, C}), view(r.lse, {a.B, a.H, a.T}),
                             int(a.H), int(kv_arg));
  }
  return r;
}
template <class S>
auto run_gqa(const std::vector<S>& qkv, const std::vector<S>& dout, const GqaShape& a) {
  return run(qkv, dout, a, a.KV, a.W());
}

// n_kv_head in {H, H/2, 1} for H = 4 and 8 (D = 16, T = 13 ends mid-way
// through nothing in particular); H = 6 with groups of 2 and 3 and D = 5;
// one token; one batch row with 8 query heads on one key/value head.
const GqaShape kShapes[] = {{2, 13, 4, 4, 16}, {2, 13, 4, 2, 16}, {2, 13, 4, 1, 16}, {3, 11, 6, 3, 5},
                            {3, 11, 6, 2, 5},  {2, 1, 4, 2, 8},   {1, 9, 8, 8, 4},   {1, 9, 8, 4, 4},
                            {1, 9, 8, 1, 4}};

template <class T>
class GqaWideTest : public ::testing::Test {};
using Wide = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GqaWideTest, Wide);

TYPED_TEST(GqaWideTest, MatchesExpandedReference) {
  using T = TypeParam;
  const bool f64 = std::is_same_v<T, double>;
  for (const GqaShape& a : kShapes) {
    SCOPED_TRACE(a.str());
    auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1611 + a.W()));
    auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1612 + a.W()));
    auto got = run_gqa(qkv, dout, a);
    GqaRef r = ref_gqa(to_f64(qkv), to_f64(dout), a);
    expect_near(got.out, r.out, f64 ? 1e-12 : 1e-5, "out");
    expect_near(got.lse, r.lse, f64 ? 1e-12 : 1e-5, "lse");
    expect_near(got.dqkv, r.dqkv, f64 ? 1e-12 : 1e-5, "dqkv");
  }
}

// The kernel on grouped qkv against the same kernel on the expanded
// multi-head qkv: every query head does the same float operations on the same
// values, so out, lse and dq agree bit for bit, and dk, dv of a key/value
// head are the double sum (in head order) of its query heads' multi-head dk,
// dv, rounded once. This pins the head mapping exactly.
TYPED_TEST(GqaWideTest, EqualsMultiHeadOnExpandedKeysBitwise) {
  using T = TypeParam;
  for (const GqaShape& a : kShapes) {
    SCOPED_TRACE(a.str());
    auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1621 + a.W()));
    auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1622));
    auto got = run_gqa(qkv, dout, a);
    GqaShape mha = a;
    mha.KV = a.H;
    auto q3 = cast_vec<T>(expand_kv(to_f64(qkv), a));
    auto m = run(q3, dout, mha, 0, 3 * a.C());
    EXPECT_EQ(got.out, m.out);
    EXPECT_EQ(got.lse, m.lse);
    // dq as is; dk, dv: double sums over the group, in head order.
    const int64_t C = a.C(), W = a.W(), G = a.H / a.KV;
    std::vector<T> want(got.dqkv.size());
    for (int64_t bt = 0; bt < a.B * a.T; ++bt)
      for (int64_t g = 0; g < a.KV; ++g)
        for (int64_t d = 0; d < a.D; ++d) {
          double sk = 0, sv = 0;
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {
            want[bt * W + h * a.D + d] = m.dqkv[bt * 3 * C + h * a.D + d];
            sk += double(m.dqkv[bt * 3 * C + C + h * a.D + d]);
            sv += double(m.dqkv[bt * 3 * C + 2 * C + h * a.D + d]);
          }
          want[bt * W + C + g * a.D + d] = G > 1 ? T(sk) : m.dqkv[bt * 3 * C + C + g * a.D + d];
          want[bt * W + C + (a.KV + g) * a.D + d] = G > 1 ? T(sv) : m.dqkv[bt * 3 * C + 2 * C + g * a.D + d];
        }
    EXPECT_EQ(got.dqkv, want);
  }
}

// n_kv_head = n_head is the multi-head op: passing it gives the bytes of the
// call without it.
TYPED_TEST(GqaWideTest, KvEqualToHeadsIsTheDefault) {
  using T = TypeParam;
  const GqaShape a{2, 13, 4, 4, 16};
  auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1631));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1632));
  auto with = run(qkv, dout, a, a.H, a.W());
  auto without = run(qkv, dout, a, 0, a.W());
  EXPECT_EQ(with.out, without.out);
  EXPECT_EQ(with.lse, without.lse);
  EXPECT_EQ(with.dqkv, without.dqkv);
}

// One task per (batch, key/value head) in backward: no two threads write the
// same dk or dv, so the thread count does not change a bit.
TYPED_TEST(GqaWideTest, IndependentOfThreadCount) {
  using T = TypeParam;
  const GqaShape a{3, 10, 6, 2, 8};
  auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1641));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1642));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto one = run_gqa(qkv, dout, a);
  omp_set_num_threads(4);
  auto four = run_gqa(qkv, dout, a);
  omp_set_num_threads(saved);
  EXPECT_EQ(one.out, four.out);
  EXPECT_EQ(one.lse, four.lse);
  EXPECT_EQ(one.dqkv, four.dqkv);
}

// A tensor-parallel rank of P holds query heads [r H/P, (r+1) H/P) and
// key/value heads [r KV/P, (r+1) KV/P) in the same packed layout, and each
// group stays on one rank; so the kernel on a rank's columns, told H/P and
// KV/P, gives exactly that rank's columns of the whole op's out, lse and
// dqkv.
TYPED_TEST(GqaWideTest, TensorParallelSliceIsTheWholeOpsSlice) {
  using T = TypeParam;
  const GqaShape a{2, 9, 8, 4, 4};
  auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1671));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1672));
  auto whole = run_gqa(qkv, dout, a);
  for (int64_t P : {2, 4}) {
    const GqaShape s{a.B, a.T, a.H / P, a.KV / P, a.D};
    for (int64_t r = 0; r < P; ++r) {
      SCOPED_TRACE(testing::Message() << "tp " << P << " rank " << r);
      // Column ranges of rank r: its q, k and v blocks of a qkv row; its heads of out.
      const int64_t qc = s.H * a.D, kc = s.KV * a.D;
      const int64_t qkv_cols[3][2] = {{r * qc, qc}, {a.C() + r * kc, kc}, {a.C() + a.KV * a.D + r * kc, kc}};
      auto cols = [&](const auto& v, int64_t rows, int64_t width, std::initializer_list<std::array<int64_t, 2>> ranges) {
        std::remove_cvref_t<decltype(v)> out;
        for (int64_t i = 0; i < rows; ++i)
          for (auto [begin, n] : ranges) out.insert(out.end(), v.begin() + i * width + begin, v.begin() + i * width + begin + n);
        return out;
      };
      const auto qkv_ranges = {std::array<int64_t, 2>{qkv_cols[0][0], qkv_cols[0][1]},
                               std::array<int64_t, 2>{qkv_cols[1][0], qkv_cols[1][1]},
                               std::array<int64_t, 2>{qkv_cols[2][0], qkv_cols[2][1]}};
      const auto out_range = {std::array<int64_t, 2>{r * qc, qc}};
      auto part = run_gqa(cols(qkv, a.B * a.T, a.W(), qkv_ranges), cols(dout, a.B * a.T, a.C(), out_range), s);
      EXPECT_EQ(part.out, cols(whole.out, a.B * a.T, a.C(), out_range));
      EXPECT_EQ(part.lse, cols(whole.lse, a.B, a.H * a.T, {std::array<int64_t, 2>{r * s.H * a.T, s.H * a.T}}));
      EXPECT_EQ(part.dqkv, cols(whole.dqkv, a.B * a.T, a.W(), qkv_ranges));
    }
  }
}

// Central differences of L = sum(out * R) in float64 against the F64 flash
// backward with dout = R, over every element of qkv (q, k and v of each
// head), for groups of 2 and multi-query. h = 1e-6 as gradcheck.h argues.
TEST(FlashGqaGradCheck, FiniteDifferences) {
  for (const GqaShape& a : {GqaShape{2, 6, 4, 2, 4}, GqaShape{1, 7, 3, 1, 5}}) {
    SCOPED_TRACE(a.str());
    KernelContext ctx;
    Vec qkv = randn(a.B * a.T * a.W(), 1651), R = randn(a.B * a.T * a.C(), 1652);
    Vec out(a.B * a.T * a.C()), lse(a.B * a.H * a.T);
    auto loss = [&]() {
      flash_attention_forward(ctx, view(out, {a.B, a.T, a.C()}), view(lse, {a.B, a.H, a.T}),
                              view(qkv, {a.B, a.T, a.W()}), int(a.H), int(a.KV));
      double L = 0;
      for (size_t i = 0; i < out.size(); ++i) L += out[i] * R[i];
      return L;
    };
    loss();
    Vec dqkv(qkv.size());
    flash_attention_backward(ctx, view(dqkv, {a.B, a.T, a.W()}), view(R, {a.B, a.T, a.C()}),
                             view(qkv, {a.B, a.T, a.W()}), view(out, {a.B, a.T, a.C()}), view(lse, {a.B, a.H, a.T}),
                             int(a.H), int(a.KV));
    const Vec num = numeric_gradient(qkv, 1e-6, loss);
    // q, k and v parts separately, so a wrong dk cannot hide behind a right dq.
    const int64_t C = a.C(), KVD = a.KV * a.D;
    for (auto [name, begin, width] : {std::tuple{"dq", int64_t(0), C}, std::tuple{"dk", C, KVD},
                                      std::tuple{"dv", C + KVD, KVD}}) {
      Vec n, g;
      for (int64_t bt = 0; bt < a.B * a.T; ++bt)
        for (int64_t c = begin; c < begin + width; ++c) {
          n.push_back(num[bt * a.W() + c]);
          g.push_back(dqkv[bt * a.W() + c]);
        }
      EXPECT_LT(normwise_error(n, g), 1e-6) << name;
    }
  }
}

// ---------------------------------------------------------------- 16-bit storage

template <class S>
class Gqa16Test : public ::testing::Test {};
using Storage16 = ::testing::Types<bf16, f16>;
TYPED_TEST_SUITE(Gqa16Test, Storage16);

TYPED_TEST(Gqa16Test, AgainstExpandedReference) {
  using S = TypeParam;
  const double u = unit_roundoff<S>();
  for (const GqaShape& a : kShapes) {
    SCOPED_TRACE(a.str());
    auto qkv = cast_vec<S>(randn(a.B * a.T * a.W(), 1661 + a.W()));
    auto dout = cast_vec<S>(randn(a.B * a.T * a.C(), 1662 + a.W()));
    auto got = run_gqa(qkv, dout, a);
    GqaRef r = ref_gqa(to_f64(qkv), to_f64(dout), a);
    expect_near(got.out, r.out, 2 * u, "out");
    expect_mostly_rounded(got.out, r.out, 0.97, "out");
    expect_near(got.lse, r.lse, 1e-5, "lse (f32)");
    expect_near(got.dqkv, r.dqkv, 4 * u, "dqkv");
  }
}

// ---------------------------------------------------------------- bad arguments

TEST(FlashGqaErrors, HeadsNotAMultipleOfKvHeads) {
  KernelContext ctx;
  const int64_t B = 1, T = 4, D = 4, H = 6, KV = 4;
  std::vector<float> qkv(B * T * (H + 2 * KV) * D), out(B * T * H * D), lse(B * H * T);
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, H * D}), view(lse, {B, H, T}), view(qkv, {B, T, (H + 2 * KV) * D}),
                            int(H), int(KV));
  }, ErrorKind::Shape, {"flash_attention_forward", "n_head 6 is not a positive multiple of n_kv_head 4"});
  expect_error([&] {
    flash_attention_backward(ctx, view(qkv, {B, T, (H + 2 * KV) * D}), view(out, {B, T, H * D}),
                             view(qkv, {B, T, (H + 2 * KV) * D}), view(out, {B, T, H * D}), view(lse, {B, H, T}),
                             int(H), -2);
  }, ErrorKind::Shape, {"flash_attention_backward", "n_kv_head -2"});
}

TEST(FlashGqaErrors, WrongQkvWidth) {
  KernelContext ctx;
  const int64_t B = 1, T = 4, D = 4, H = 4, KV = 2;
  // The multi-head width 3 H D = 48 with 2 key/value heads: (4 + 4) D = 48 means D = 6, so out (H D = 16) is wrong;
  // 50 columns fit no head dim at all.
  std::vector<float> qkv50(B * T * 50), qkv48(B * T * 48), out(B * T * H * D), lse(B * H * T);
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, H * D}), view(lse, {B, H, T}), view(qkv50, {B, T, 50}), int(H),
                            int(KV));
  }, ErrorKind::Shape, {"flash_attention_forward", "(n_head + 2 n_kv_head) head_dim", "n_kv_head 2", "(1, 4, 50)"});
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, H * D}), view(lse, {B, H, T}), view(qkv48, {B, T, 48}), int(H),
                            int(KV));
  }, ErrorKind::Shape, {"flash_attention_forward", "out"});
  // lse has one row per query head, not per key/value head.
  std::vector<float> qkv(B * T * (H + 2 * KV) * D), lse_kv(B * KV * T);
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, H * D}), view(lse_kv, {B, KV, T}), view(qkv, {B, T, (H + 2 * KV) * D}),
                            int(H), int(KV));
  }, ErrorKind::Shape, {"flash_attention_forward", "lse"});
}

}  // namespace
}  // namespace xirang::test
