// Tests for the flash-style pair of kernels/attention.h (lse saved, the
// probabilities recomputed in backward), over every storage type (f64, f32,
// bf16, f16) and every head layout: multi-head (MHA, n_kv_head = n_head),
// grouped-query (GQA, n_head query heads sharing 1 < n_kv_head < n_head
// key/value heads) and multi-query (MQA, one key/value head). Also: the
// probability-based pair against the flash pair, and finite-difference
// checks of the F64 backward.
//
// The reference is written here from the definition: copy each key/value
// head to the H / KV query heads that use it (query head h reads key/value
// head h / (H / KV)), run plain float64 softmax attention on that
// multi-head qkv (reference.h), and fold the gradients back: dk and dv of a
// key/value head are the sums over its query heads. For MHA the copy and
// the fold are the identity.
//
// Tolerances, relative to the largest reference element (expect_near;
// FlashTol below):
// - f64: the kernel and the reference compute the same sums in another
//   order (lse and delta = dO . O instead of sum_j p_j dP_j): 1e-12.
// - f32: 1e-5 (D <= 64 term dot products, softmax over <= 200 entries:
//   relative rounding ~sqrt(n) u, under 1e-6); the group sum of dk and dv
//   adds at most 8 float-accurate terms in double, one more rounding of the
//   sum. Against the f32 probability-based pair 2e-6, the two being fp32
//   computations of the same values that differ only in rounding.
// - lse: max + log of a double sum of exps, one fp32 rounding of an O(1)
//   number plus fp32 scores: 1e-5 absolute (F32 for every 16-bit type).
// - 16-bit (u = 2^-8 bf16, 2^-11 f16; inputs rounded to the type first):
//   out is formed in float and rounded once, 2u of the scale, >= 97% exactly
//   rounded. dqkv is accumulated in float and rounded once (u), but backward
//   reads the stored (rounded) out for delta = dO . O, which moves each dS
//   by up to p u |dO| |O| relative; the gradients are sums of such terms
//   weighted by |k| or |q| (O(1)), so the error is a few u of their scale;
//   dk, dv of a group are summed in double and rounded once, and errors of
//   independent heads do not line up: 4u. The probability-based pair with
//   F32 probabilities has no delta term (2u); with 16-bit probabilities each
//   p carries u of error into dv and dS alike: 4u.
// - Scores far from 0 make the softmax backward cancel more: dqkv at 10x.
#include <omp.h>

#include <array>
#include <cmath>
#include <string>
#include <tuple>

#include "kernels/attention.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

template <class T>
struct FlashTol {
  static constexpr bool f64 = std::is_same_v<T, double>;
  static constexpr double out = f64 ? 1e-12 : stored_tol<T>(1e-5, 2);
  static constexpr double lse = f64 ? 1e-12 : 1e-5;
  static constexpr double dqkv = f64 ? 1e-12 : stored_tol<T>(1e-5, 4);
  static constexpr double vs_probs = f64 ? 1e-12 : 2e-6;  // wide types: flash against the probability pair
  static constexpr double rounded = 0.97;                  // 16-bit out: fraction rounded once
};

enum class Heads { MHA, GQA, MQA };
const char* heads_name(Heads h) { return h == Heads::MHA ? "MHA" : h == Heads::GQA ? "GQA" : "MQA"; }
void PrintTo(Heads h, std::ostream* os) { *os << heads_name(h); }

struct AttnShape {
  int64_t B, T, H, KV, D;
  int64_t C() const { return H * D; }             // out's width
  int64_t W() const { return (H + 2 * KV) * D; }  // qkv's width
  std::string str() const {
    return "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) + " KV " +
           std::to_string(KV) + " D " + std::to_string(D);
  }
};

// ---------------------------------------------------------------- reference

// The multi-head qkv (B, T, 3 H D) in which query head h sees copies of key/value head h / (H / KV).
Vec expand_kv(const Vec& qkv, const AttnShape& a) {
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
Vec fold_grads(const Vec& d3, const AttnShape& a) {
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

struct FlashRef {
  Vec out, lse, dqkv;  // (B, T, C), (B, H, T), (B, T, W)
};

FlashRef ref_flash(const Vec& qkv, const Vec& dout, const AttnShape& a) {
  const Vec q3 = expand_kv(qkv, a);
  const int64_t C = a.C();
  FlashRef r{ref_attention_forward(q3, a.B, a.T, C, a.H).out, Vec(a.B * a.H * a.T),
             fold_grads(ref_attention_backward(dout, q3, a.B, a.T, C, a.H), a)};
  // lse: log sum_{s <= t} exp(scale q_t . k_s).
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

// ---------------------------------------------------------------- running the kernels

template <class S>
struct FlashRun {
  std::vector<S> out, dqkv;
  std::vector<StatType<S>> lse;
};

// Flash forward then backward with n_kv_head = kv_arg (0: the default
// argument) over qkv of `width` columns, into outputs pre-filled with random
// values.
template <class S>
FlashRun<S> run_flash(const std::vector<S>& qkv_in, const std::vector<S>& dout_in, const AttnShape& a,
                      int64_t kv_arg, int64_t width) {
  KernelContext ctx;
  auto qkv = qkv_in, dout = dout_in;
  const int64_t C = a.C();
  FlashRun<S> r{cast_vec<S>(randn(a.B * a.T * C, 1601)), cast_vec<S>(randn(a.B * a.T * width, 1602)),
                cast_vec<StatType<S>>(randn(a.B * a.H * a.T, 1603))};
  Tensor out = view(r.out, {a.B, a.T, C}), lse = view(r.lse, {a.B, a.H, a.T}), q = view(qkv, {a.B, a.T, width});
  if (kv_arg == 0) {
    flash_attention_forward(ctx, out, lse, q, int(a.H));
    flash_attention_backward(ctx, view(r.dqkv, {a.B, a.T, width}), view(dout, {a.B, a.T, C}), q, out, lse, int(a.H));
  } else {
    flash_attention_forward(ctx, out, lse, q, int(a.H), int(kv_arg));
    flash_attention_backward(ctx, view(r.dqkv, {a.B, a.T, width}), view(dout, {a.B, a.T, C}), q, out, lse, int(a.H),
                             int(kv_arg));
  }
  return r;
}
template <class S>
FlashRun<S> run_flash(const std::vector<S>& qkv, const std::vector<S>& dout, const AttnShape& a) {
  return run_flash(qkv, dout, a, a.KV, a.W());
}

template <class S>
void expect_same_run(const FlashRun<S>& got, const FlashRun<S>& want, const std::string& what) {
  EXPECT_EQ(bytes_of(got.out), bytes_of(want.out)) << what << ": out";
  EXPECT_EQ(bytes_of(got.lse), bytes_of(want.lse)) << what << ": lse";
  EXPECT_EQ(bytes_of(got.dqkv), bytes_of(want.dqkv)) << what << ": dqkv";
}

// The probability-based pair (multi-head only), probabilities stored as P.
template <class S, class P>
std::pair<std::vector<S>, std::vector<S>> run_probs(const std::vector<S>& qkv_in, const std::vector<S>& dout_in,
                                                    const AttnShape& a) {
  KernelContext ctx;
  auto qkv = qkv_in, dout = dout_in;
  const int64_t C = a.C();
  auto out = cast_vec<S>(randn(a.B * a.T * C, 1504));
  auto probs = cast_vec<P>(randn(a.B * a.H * a.T * a.T, 1505));
  auto dqkv = cast_vec<S>(randn(a.B * a.T * 3 * C, 1506));
  attention_forward(ctx, view(out, {a.B, a.T, C}), view(probs, {a.B, a.H, a.T, a.T}), view(qkv, {a.B, a.T, 3 * C}),
                    int(a.H));
  attention_backward(ctx, view(dqkv, {a.B, a.T, 3 * C}), view(dout, {a.B, a.T, C}), view(qkv, {a.B, a.T, 3 * C}),
                     view(probs, {a.B, a.H, a.T, a.T}), int(a.H));
  return {out, dqkv};
}

// ---------------------------------------------------------------- shapes by layout

struct LayoutShapes {
  std::vector<AttnShape> short_rows;  // odd sizes against the reference
  AttnShape large_scores, threads;    // scale-4 inputs; the thread-count check
  std::vector<AttnShape> long_rows;   // several 32-row query blocks of the blocked f32 path
  AttnShape long_threads;
  std::vector<AttnShape> tensor_parallel;  // H and KV divisible by 2 and 4 (none for MQA)
};

// T = 13, D = 16; D = 5; one head; one token; 8 query heads. GQA: groups of
// 2, 3 and 4; MQA: 4 and 8 query heads on one key/value head. Long rows: T =
// 200 (six full blocks and one of 8 rows, T not a multiple of 16) with D up
// to 64, and T = 131 with D = 20 or 10 (head width padded to 16).
const LayoutShapes& shapes_of(Heads h) {
  static const LayoutShapes mha{{{2, 13, 3, 3, 16}, {3, 11, 3, 3, 5}, {2, 9, 1, 1, 8}, {2, 1, 4, 4, 3},
                                 {2, 13, 4, 4, 16}, {1, 9, 8, 8, 4}},
                                {1, 12, 2, 2, 8},
                                {3, 10, 4, 4, 6},
                                {{2, 200, 2, 2, 64}, {1, 131, 2, 2, 20}},
                                {3, 150, 2, 2, 64},
                                {{2, 9, 8, 8, 4}}};
  static const LayoutShapes gqa{{{2, 13, 4, 2, 16}, {3, 11, 6, 3, 5}, {3, 11, 6, 2, 5}, {2, 1, 4, 2, 8}, {1, 9, 8, 4, 4}},
                                {1, 12, 4, 2, 8},
                                {3, 10, 6, 2, 8},
                                {{2, 200, 4, 2, 32}, {1, 131, 4, 2, 10}},
                                {3, 150, 4, 2, 32},
                                {{2, 9, 8, 4, 4}}};
  static const LayoutShapes mqa{{{2, 13, 4, 1, 16}, {1, 9, 8, 1, 4}, {2, 1, 3, 1, 4}},
                                {1, 12, 2, 1, 8},
                                {3, 10, 6, 1, 8},
                                {{2, 200, 4, 1, 32}, {1, 131, 2, 1, 20}},
                                {3, 150, 4, 1, 32},
                                {}};
  return h == Heads::MHA ? mha : h == Heads::GQA ? gqa : mqa;
}

// ---------------------------------------------------------------- the suite: storage type x head layout

class FlashAttentionTest : public ::testing::TestWithParam<std::tuple<DType, Heads>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  const LayoutShapes& shapes() const { return shapes_of(std::get<1>(GetParam())); }
};

std::string flash_param_name(const ::testing::TestParamInfo<std::tuple<DType, Heads>>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" + heads_name(std::get<1>(info.param));
}
INSTANTIATE_TEST_SUITE_P(Layouts, FlashAttentionTest,
                         ::testing::Combine(::testing::Values(DType::F64, DType::F32, DType::BF16, DType::F16),
                                            ::testing::Values(Heads::MHA, Heads::GQA, Heads::MQA)),
                         flash_param_name);

template <class T>
void check_against_reference(const AttnShape& a, uint64_t seed, double input_scale, double dqkv_factor) {
  using Tol = FlashTol<T>;
  SCOPED_TRACE(a.str());
  auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), seed, input_scale));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), seed + 1));
  auto got = run_flash(qkv, dout, a);
  FlashRef r = ref_flash(to_f64(qkv), to_f64(dout), a);
  expect_stored(got.out, r.out, Tol::out, Tol::rounded, "out");
  expect_near(got.lse, r.lse, Tol::lse, "lse");
  expect_near(got.dqkv, r.dqkv, dqkv_factor * Tol::dqkv, "dqkv");
}

TEST_P(FlashAttentionTest, AgainstReference) {
  with_storage_type(dtype(), [&]<class T> {
    for (const AttnShape& a : shapes().short_rows) check_against_reference<T>(a, 1611 + a.W(), 1.0, 1.0);
  });
}

// Scores far from 0 (q and k of scale 4: |s| up to ~30) overflow exp()
// unless the row max is subtracted; lse is then large, and compared
// relative to its own size.
TEST_P(FlashAttentionTest, LargeScoresStayFinite) {
  with_storage_type(dtype(), [&]<class T> { check_against_reference<T>(shapes().large_scores, 1521, 4.0, 10.0); });
}

// Long rows for the blocked path, against the reference with the tolerances
// of the short shapes: each output is still one computation of O(1) values,
// now with up to 64-term dot products and 200-term sums over keys.
TEST_P(FlashAttentionTest, ManyQueryBlocksAgainstReference) {
  with_storage_type(dtype(), [&]<class T> {
    for (const AttnShape& a : shapes().long_rows) check_against_reference<T>(a, 1541 + a.T, 1.0, 1.0);
  });
}

// Results do not depend on the thread count: one task per (batch, head) in
// forward and per (batch, key/value head) in backward, so no two threads
// write the same dk or dv. Short rows and several query blocks.
TEST_P(FlashAttentionTest, IndependentOfThreadCount) {
  with_storage_type(dtype(), [&]<class T> {
    for (const AttnShape& a : {shapes().threads, shapes().long_threads}) {
      SCOPED_TRACE(a.str());
      auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1641));
      auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1642));
      const int saved = omp_get_max_threads();
      std::vector<FlashRun<T>> runs;
      for (int threads : {1, 3, 4}) {
        omp_set_num_threads(threads);
        runs.push_back(run_flash(qkv, dout, a));
      }
      omp_set_num_threads(saved);
      expect_same_run(runs[1], runs[0], "3 threads");
      expect_same_run(runs[2], runs[0], "4 threads");
    }
  });
}

// The kernel on grouped qkv against the same kernel on the expanded
// multi-head qkv: every query head does the same float operations on the
// same values, so out, lse and dq agree bit for bit. In the wide types dk,
// dv of a key/value head are the double sum (in head order) of its query
// heads' multi-head dk, dv, rounded once; a 16-bit multi-head run rounds
// each head's share first, so there only out, lse and dq are compared. This
// pins the head mapping exactly.
TEST_P(FlashAttentionTest, EqualsMultiHeadOnExpandedKeys) {
  with_storage_type(dtype(), [&]<class T> {
    for (const AttnShape& a : shapes().short_rows) {
      SCOPED_TRACE(a.str());
      auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1621 + a.W()));
      auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1622));
      auto got = run_flash(qkv, dout, a);
      AttnShape mha = a;
      mha.KV = a.H;
      auto m = run_flash(cast_vec<T>(expand_kv(to_f64(qkv), a)), dout, mha, 0, 3 * a.C());
      EXPECT_EQ(bytes_of(got.out), bytes_of(m.out)) << "out";
      EXPECT_EQ(bytes_of(got.lse), bytes_of(m.lse)) << "lse";
      const int64_t C = a.C(), W = a.W(), G = a.H / a.KV;
      const Vec md = to_f64(m.dqkv);
      Vec want(got.dqkv.size()), have = to_f64(got.dqkv);
      for (int64_t bt = 0; bt < a.B * a.T; ++bt)
        for (int64_t g = 0; g < a.KV; ++g)
          for (int64_t d = 0; d < a.D; ++d) {
            double sk = 0, sv = 0;
            for (int64_t h = g * G; h < (g + 1) * G; ++h) {
              want[bt * W + h * a.D + d] = md[bt * 3 * C + h * a.D + d];
              sk += md[bt * 3 * C + C + h * a.D + d];
              sv += md[bt * 3 * C + 2 * C + h * a.D + d];
            }
            want[bt * W + C + g * a.D + d] = rounded<T>(Vec{sk})[0];
            want[bt * W + C + (a.KV + g) * a.D + d] = rounded<T>(Vec{sv})[0];
          }
      if constexpr (is_16bit_v<T>) {
        for (int64_t bt = 0; bt < a.B * a.T; ++bt)
          for (int64_t c = C; c < W; ++c) want[bt * W + c] = have[bt * W + c];
      }
      EXPECT_EQ(have, want) << "dqkv";
    }
  });
}

// A tensor-parallel rank of P holds query heads [r H/P, (r+1) H/P) and
// key/value heads [r KV/P, (r+1) KV/P) in the same packed layout, and each
// group stays on one rank; so the kernel on a rank's columns, told H/P and
// KV/P, gives exactly that rank's columns of the whole op's out, lse and
// dqkv. (One key/value head cannot be split: MQA is not sharded by heads.)
TEST_P(FlashAttentionTest, TensorParallelSliceIsTheWholeOpsSlice) {
  if (shapes().tensor_parallel.empty()) GTEST_SKIP() << "a single key/value head is not split across ranks";
  with_storage_type(dtype(), [&]<class T> {
    for (const AttnShape& a : shapes().tensor_parallel) {
      auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1671));
      auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1672));
      auto whole = run_flash(qkv, dout, a);
      for (int64_t P : {2, 4}) {
        const AttnShape s{a.B, a.T, a.H / P, a.KV / P, a.D};
        for (int64_t r = 0; r < P; ++r) {
          SCOPED_TRACE(testing::Message() << a.str() << " tp " << P << " rank " << r);
          // Column ranges of rank r: its q, k and v blocks of a qkv row; its heads of out.
          const int64_t qc = s.H * a.D, kc = s.KV * a.D;
          using Ranges = std::vector<std::array<int64_t, 2>>;
          const Ranges qkv_ranges{{r * qc, qc}, {a.C() + r * kc, kc}, {a.C() + a.KV * a.D + r * kc, kc}};
          const Ranges out_range{{r * qc, qc}};
          auto cols = [](const auto& v, int64_t rows, int64_t width, const Ranges& ranges) {
            std::remove_cvref_t<decltype(v)> out;
            for (int64_t i = 0; i < rows; ++i)
              for (auto [begin, n] : ranges)
                out.insert(out.end(), v.begin() + i * width + begin, v.begin() + i * width + begin + n);
            return out;
          };
          auto part = run_flash(cols(qkv, a.B * a.T, a.W(), qkv_ranges), cols(dout, a.B * a.T, a.C(), out_range), s);
          EXPECT_EQ(bytes_of(part.out), bytes_of(cols(whole.out, a.B * a.T, a.C(), out_range))) << "out";
          EXPECT_EQ(bytes_of(part.lse), bytes_of(cols(whole.lse, a.B, a.H * a.T, Ranges{{r * s.H * a.T, s.H * a.T}})))
              << "lse";
          EXPECT_EQ(bytes_of(part.dqkv), bytes_of(cols(whole.dqkv, a.B * a.T, a.W(), qkv_ranges))) << "dqkv";
        }
      }
    }
  });
}

// ---------------------------------------------------------------- by storage type alone

template <class T>
class FlashAttentionTypedTest : public ::testing::Test {};
TYPED_TEST_SUITE(FlashAttentionTypedTest, StorageTypes, StorageTypeNames);

// n_kv_head = n_head is the multi-head op: passing it gives the bytes of the
// call without it.
TYPED_TEST(FlashAttentionTypedTest, KvEqualToHeadsIsTheDefault) {
  using T = TypeParam;
  const AttnShape a{2, 13, 4, 4, 16};
  auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1631));
  auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1632));
  expect_same_run(run_flash(qkv, dout, a, a.H, a.W()), run_flash(qkv, dout, a, 0, a.W()), "n_kv_head = n_head");
}

// The probability-based pair (multi-head): in the wide types the flash pair
// matches it to rounding; with 16-bit storage it is checked against the
// reference with F32 and with 16-bit probabilities.
TYPED_TEST(FlashAttentionTypedTest, ProbabilityPair) {
  using T = TypeParam;
  using Tol = FlashTol<T>;
  for (const AttnShape& a : shapes_of(Heads::MHA).short_rows) {
    SCOPED_TRACE(a.str());
    auto qkv = cast_vec<T>(randn(a.B * a.T * a.W(), 1511 + a.C()));
    auto dout = cast_vec<T>(randn(a.B * a.T * a.C(), 1512 + a.C()));
    if constexpr (!is_16bit_v<T>) {
      auto fl = run_flash(qkv, dout, a);
      auto [p_out, p_dqkv] = run_probs<T, T>(qkv, dout, a);
      expect_near(fl.out, to_f64(p_out), Tol::vs_probs, "out vs probability attention");
      expect_near(fl.dqkv, to_f64(p_dqkv), Tol::vs_probs, "dqkv vs probability attention");
    } else {
      const double u = unit_roundoff<T>();
      const FlashRef r = ref_flash(to_f64(qkv), to_f64(dout), a);
      {
        SCOPED_TRACE("f32 probabilities");
        auto [out, dqkv] = run_probs<T, float>(qkv, dout, a);
        expect_stored(out, r.out, 2 * u, 0.97, "out");
        expect_stored(dqkv, r.dqkv, 2 * u, 0.9, "dqkv");
      }
      {
        SCOPED_TRACE("16-bit probabilities");
        auto [out, dqkv] = run_probs<T, T>(qkv, dout, a);
        expect_near(out, r.out, 2 * u, "out");
        expect_near(dqkv, r.dqkv, 4 * u, "dqkv");
      }
    }
  }
}

// ---------------------------------------------------------------- float64 gradient check

// Central differences of L = sum(out * R) in float64 against the F64 flash
// backward with dout = R, over every element of qkv (the forward recomputed
// for each perturbation), in each layout; q, k and v parts compared
// separately, so a wrong dk cannot hide behind a right dq. h = 1e-6:
// truncation ~1e-12, roundoff ~1e-16 |L| / h ~ 1e-9; the norm-wise bound is
// 1e-6.
TEST(FlashAttentionGradCheck, FiniteDifferences) {
  for (const AttnShape& a : {AttnShape{2, 6, 3, 3, 4}, AttnShape{2, 6, 4, 2, 4}, AttnShape{1, 7, 3, 1, 5}}) {
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

// ---------------------------------------------------------------- bad arguments

TEST(FlashAttentionErrors, LseShapeAndDtype) {
  KernelContext ctx;
  const int64_t B = 1, T = 4, C = 12, H = 3;
  std::vector<bf16> qkv(B * T * 3 * C), out(B * T * C), lse16(B * H * T);
  std::vector<float> lse(B * H * T), lse_short(B * H * (T - 1));
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, C}), view(lse16, {B, H, T}), view(qkv, {B, T, 3 * C}), int(H));
  }, ErrorKind::Shape, {"flash_attention_forward", "lse", "f32"});
  expect_error([&] {
    flash_attention_forward(ctx, view(out, {B, T, C}), view(lse_short, {B, H, T - 1}), view(qkv, {B, T, 3 * C}), int(H));
  }, ErrorKind::Shape, {"flash_attention_forward", "lse"});
  std::vector<double> dout64(B * T * C);
  std::vector<bf16> dqkv(B * T * 3 * C);
  expect_error([&] {
    flash_attention_backward(ctx, view(dqkv, {B, T, 3 * C}), view(dout64, {B, T, C}), view(qkv, {B, T, 3 * C}),
                             view(out, {B, T, C}), view(lse, {B, H, T}), int(H));
  }, ErrorKind::Shape, {"flash_attention_backward", "dout"});
}

TEST(FlashAttentionErrors, HeadsNotAMultipleOfKvHeads) {
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

TEST(FlashAttentionErrors, WrongQkvWidth) {
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
