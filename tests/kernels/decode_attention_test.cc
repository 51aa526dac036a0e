// decode_attention_forward (kernels/decode_attention.h) on the CPU:
// - against a float64 reference written here from the definition (new token
//   i at position pos + i attends to the keys and values of positions
//   [0, pos + i], query head h to key/value head h / (H / KV)), for prefill,
//   token-by-token decoding and chunks of several tokens after a cached
//   prefix, multi-head and grouped-query, in f64, f32 and bf16;
// - against the flash forward of kernels/attention.h: a prefill of T tokens
//   gives flash attention's output, and decoding one token at a time gives
//   the rows of one causal pass over the whole sequence;
// - the caches hold the new keys and values at their positions and nothing
//   else is written;
// - the result is the same bit for bit for 1 and 3 OpenMP threads;
// - positions past the cache and mismatched shapes are Shape errors.
//
// Tolerances (relative to max(1, max |ref|), expect_near): f64 1e-12 (only
// the order of sums differs); f32 1e-5, as the flash tests (D <= 16 term dot
// products, softmax over <= 40 keys); bf16 4u = 2^-6 (the outputs are rounded
// once, the inputs are the exact bf16 values the reference also reads).
// Against flash attention in f32: 1e-6 (the same arithmetic in the same
// order; only code generation of the two loops may differ).
#include <omp.h>

#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/decode_attention.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

struct Shape4 {
  int64_t B, H, KV, D, T_max;
  int64_t C() const { return H * D; }
  int64_t W() const { return (H + 2 * KV) * D; }
  int64_t KVD() const { return KV * D; }
  std::string str() const {
    return "B " + std::to_string(B) + " H " + std::to_string(H) + " KV " + std::to_string(KV) + " D " +
           std::to_string(D) + " T_max " + std::to_string(T_max);
  }
};

// The whole sequence's qkv (B, T, W) as float64: out (B, n, C) of rows
// [pos, pos + n), each attending to rows [0, its own].
Vec ref_rows(const Vec& qkv, const Shape4& s, int64_t T, int64_t pos, int64_t n) {
  const int64_t W = s.W(), C = s.C(), G = s.H / s.KV;
  Vec out(size_t(s.B * n * C), 0.0);
  const double scale = 1.0 / std::sqrt(double(s.D));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = pos + i, g = h / G;
        const double* q = &qkv[size_t((b * T + t) * W + h * s.D)];
        std::vector<double> p(size_t(t + 1));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= t; ++j) {
          const double* k = &qkv[size_t((b * T + j) * W + C + g * s.D)];
          double d = 0;
          for (int64_t c = 0; c < s.D; ++c) d += q[c] * k[c];
          p[size_t(j)] = d * scale;
          mx = std::max(mx, p[size_t(j)]);
        }
        for (auto& x : p) sum += (x = std::exp(x - mx));
        for (int64_t j = 0; j <= t; ++j) {
          const double* v = &qkv[size_t((b * T + j) * W + C + (s.KV + g) * s.D)];
          for (int64_t c = 0; c < s.D; ++c) out[size_t((b * n + i) * C + h * s.D + c)] += p[size_t(j)] / sum * v[c];
        }
      }
  return out;
}

// Rows [pos, pos + n) of a (B, T, W) buffer.
template <class S>
std::vector<S> rows_of(const std::vector<S>& x, int64_t B, int64_t T, int64_t W, int64_t pos, int64_t n) {
  std::vector<S> r(size_t(B * n * W));
  for (int64_t b = 0; b < B; ++b)
    std::copy(x.begin() + (b * T + pos) * W, x.begin() + (b * T + pos + n) * W, r.begin() + b * n * W);
  return r;
}

// Runs the sequence's qkv through the caches in chunks (the sizes in
// `chunks`, summing to T) and returns every row's output (B, T, C).
template <class S>
std::vector<S> run_chunks(const std::vector<S>& qkv, const Shape4& s, int64_t T, const std::vector<int64_t>& chunks,
                          std::vector<S>& kc, std::vector<S>& vc) {
  const int64_t C = s.C(), W = s.W();
  kc.assign(size_t(s.B * s.T_max * s.KVD()), S(0));
  vc = kc;
  std::vector<S> all(size_t(s.B * T * C));
  int64_t pos = 0;
  for (int64_t n : chunks) {
    std::vector<S> in = rows_of(qkv, s.B, T, W, pos, n), out(size_t(s.B * n * C));
    decode_attention_forward(KernelContext{}, view(out, {s.B, n, C}), view(kc, {s.B, s.T_max, s.KVD()}),
                             view(vc, {s.B, s.T_max, s.KVD()}), view(in, {s.B, n, W}), pos, int(s.H), int(s.KV));
    for (int64_t b = 0; b < s.B; ++b)
      std::copy(out.begin() + b * n * C, out.begin() + (b + 1) * n * C, all.begin() + (b * T + pos) * C);
    pos += n;
  }
  return all;
}

const Shape4 kShapes[] = {{2, 4, 4, 8, 24}, {1, 6, 2, 16, 40}, {3, 4, 1, 4, 17}, {1, 8, 4, 8, 33}};

template <class S>
void check_against_reference(double rel) {
  for (const Shape4& s : kShapes) {
    const int64_t T = s.T_max - 3;  // leave unused cache positions
    const Vec x = randn(size_t(s.B * T * s.W()), 11 + uint64_t(s.W()), 1.5);
    const std::vector<S> qkv = cast_vec<S>(x);
    const Vec xr = to_f64(qkv);
    const Vec ref = ref_rows(xr, s, T, 0, T);
    std::vector<S> kc, vc;
    // Prefill of everything; token by token; a prefix then uneven chunks.
    std::vector<int64_t> ones(size_t(T), 1), mixed{5, 1, 3};
    mixed.push_back(T - 9);
    for (const auto& chunks : {std::vector<int64_t>{T}, ones, mixed}) {
      const std::vector<S> got = run_chunks(qkv, s, T, chunks, kc, vc);
      expect_near(got, ref, rel, "decode out, " + s.str() + ", " + std::to_string(chunks.size()) + " chunks");
      // The caches hold each position's k and v as given; positions past T are untouched.
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t t = 0; t < s.T_max; ++t)
          for (int64_t c = 0; c < s.KVD(); ++c) {
            const size_t at = size_t((b * s.T_max + t) * s.KVD() + c);
            const double k = t < T ? xr[size_t((b * T + t) * s.W() + s.C() + c)] : 0.0;
            const double v = t < T ? xr[size_t((b * T + t) * s.W() + s.C() + s.KVD() + c)] : 0.0;
            ASSERT_EQ(as_double(kc[at]), k) << "k cache " << s.str() << " b " << b << " t " << t << " c " << c;
            ASSERT_EQ(as_double(vc[at]), v) << "v cache " << s.str() << " b " << b << " t " << t << " c " << c;
          }
    }
  }
}

TEST(DecodeAttention, MatchesReferenceF64) { check_against_reference<double>(1e-12); }
TEST(DecodeAttention, MatchesReferenceF32) { check_against_reference<float>(1e-5); }
TEST(DecodeAttention, MatchesReferenceBF16) { check_against_reference<bf16>(4 * unit_roundoff<bf16>()); }

// Prefill equals the flash forward; token-by-token decoding equals its rows.
TEST(DecodeAttention, MatchesFlashAttention) {
  for (const Shape4& s : kShapes) {
    const int64_t T = s.T_max, C = s.C(), W = s.W();
    std::vector<float> qkv = cast_vec<float>(randn(size_t(s.B * T * W), 21 + uint64_t(W), 2.0));
    std::vector<float> flash(size_t(s.B * T * C)), lse(size_t(s.B * s.H * T));
    flash_attention_forward(KernelContext{}, view(flash, {s.B, T, C}), view(lse, {s.B, s.H, T}),
                            view(qkv, {s.B, T, W}), int(s.H), int(s.KV));
    std::vector<float> kc, vc;
    const std::vector<float> prefill = run_chunks(qkv, s, T, {T}, kc, vc);
    const std::vector<float> stepwise = run_chunks(qkv, s, T, std::vector<int64_t>(size_t(T), 1), kc, vc);
    expect_near(prefill, to_f64(flash), 1e-6, "prefill vs flash, " + s.str());
    expect_near(stepwise, to_f64(flash), 1e-6, "token by token vs flash, " + s.str());
  }
}

TEST(DecodeAttention, SameBitsForAnyThreadCount) {
  const Shape4 s{3, 8, 2, 16, 50};
  const int64_t T = 47;
  std::vector<float> qkv = cast_vec<float>(randn(size_t(s.B * T * s.W()), 5, 1.0));
  const int before = omp_get_max_threads();
  std::vector<float> kc, vc;
  omp_set_num_threads(1);
  const std::vector<float> one = run_chunks(qkv, s, T, {20, 1, 1, 25}, kc, vc);
  omp_set_num_threads(3);
  const std::vector<float> three = run_chunks(qkv, s, T, {20, 1, 1, 25}, kc, vc);
  omp_set_num_threads(before);
  ASSERT_EQ(bytes_of(one), bytes_of(three));
}

TEST(DecodeAttention, BadShapes) {
  const Shape4 s{1, 4, 2, 8, 10};
  std::vector<float> qkv(size_t(3 * s.W()), 0.5f), out(size_t(3 * s.C())), kc(size_t(s.T_max * s.KVD())), vc = kc;
  auto run = [&](int64_t pos, Shape cache_shape, int kv) {
    decode_attention_forward(KernelContext{}, view(out, {1, 3, s.C()}), Tensor(kc.data(), cache_shape, DType::F32),
                             Tensor(vc.data(), cache_shape, DType::F32), view(qkv, {1, 3, s.W()}), pos, int(s.H), kv);
  };
  run(7, {1, 10, 16}, 2);  // positions 7, 8, 9: the last ones that fit
  expect_error([&] { run(8, {1, 10, 16}, 2); }, ErrorKind::Shape,
               {"decode_attention_forward", "[8, 11)", "cache of 10 positions"});
  expect_error([&] { run(-1, {1, 10, 16}, 2); }, ErrorKind::Shape, {"decode_attention_forward", "[-1, 2)"});
  expect_error([&] { run(0, {1, 5, 32}, 2); }, ErrorKind::Shape, {"k_cache must be", "(1, T_max, 16)"});
  expect_error([&] { run(0, {1, 10, 16}, 3); }, ErrorKind::Shape, {"not a positive multiple of n_kv_head 3"});
}

}  // namespace
}  // namespace xirang::test
