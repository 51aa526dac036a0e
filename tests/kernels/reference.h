// tests/kernels/reference.h: float64 reference implementations and test helpers.
//
// Every reference here is written from the op's math, never by calling a
// kernel, so that a kernel test compares two independent computations. The
// references work on std::vector<double> in row-major order; the shapes follow
// the kernel headers (kernels/*.h), which are the contract.
//
//   Vec x = randn(N * C, 1);                      // random, never zeros
//   auto xs = cast_vec<float>(x);                 // kernel storage
//   Vec xr = to_f64(xs);                          // the exact values the kernel sees
//   expect_near(ys, ref_gelu_vec(xr), 1e-5, "gelu y");
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/context.h"

namespace xirang::test {

using Vec = std::vector<double>;

// ---------------------------------------------------------------- random data
// std::mt19937_64, not the project's Philox, so test inputs do not depend on
// code under test. A continuous distribution never yields exact zeros in
// practice, which keeps "forgot to write the output" bugs visible.

inline Vec randn(size_t n, uint64_t seed, double scale = 1.0, double shift = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  Vec v(n);
  for (auto& x : v) x = shift + scale * dist(gen);
  return v;
}

inline Vec randu(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Integers uniform in [lo, hi).
inline std::vector<int32_t> rand_int(size_t n, uint64_t seed, int32_t lo, int32_t hi) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// ---------------------------------------------------------------- storage
template <class T>
constexpr bool is_16bit_v = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// Values stored as T (16-bit types through core/dtype's rounding: the tests
// only need inputs the kernel can hold; references then read them back).
template <class T>
std::vector<T> cast_vec(const Vec& v) {
  if constexpr (std::is_same_v<T, bf16>) {
    std::vector<T> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = float_to_bf16(float(v[i]));
    return r;
  } else if constexpr (std::is_same_v<T, f16>) {
    std::vector<T> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = float_to_f16(float(v[i]));
    return r;
  } else {
    return std::vector<T>(v.begin(), v.end());
  }
}

inline double as_double(bf16 x) { return bf16_to_float(x); }
inline double as_double(f16 x) { return f16_to_float(x); }
inline double as_double(float x) { return x; }
inline double as_double(double x) { return x; }

template <class T>
Vec to_f64(const std::vector<T>& v) {
  Vec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = as_double(v[i]);
  return r;
}

// v rounded to T and read back: the exact values a kernel sees as inputs.
template <class T>
Vec rounded(const Vec& v) {
  return to_f64(cast_vec<T>(v));
}

// Unit roundoff of a stored T: rounding to nearest changes a value by at
// most u |x|, u = 2^-p for p significant bits (bf16 8, f16 11, f32 24).
template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, bf16>) return 0x1p-8;
  else if constexpr (std::is_same_v<T, f16>) return 0x1p-11;
  else if constexpr (std::is_same_v<T, float>) return 0x1p-24;
  else return 0x1p-53;
}

// A Tensor over a vector; the element count must match the shape.
template <class T>
Tensor view(std::vector<T>& v, Shape s) {
  XR_CHECK(int64_t(v.size()) == s.numel(), "vector of ", v.size(), " for shape ", s.str());
  return Tensor(v.data(), s, dtype_of<T>::value);
}

// The tolerance for a compute type: the fp32 one given by the test (and
// justified there), 1e-10 for the float64 path, where only summation order
// differs from the reference (errors ~1e-15 relative).
template <class T>
constexpr double tol(double f32_tol) {
  return std::is_same_v<T, float> ? f32_tol : 1e-10;
}

// max |got - ref| <= rel * max(1, max |ref|). One number per output keeps
// failures readable; the message names the worst element. NaN counts as a
// failure (a plain <= comparison would let it through).
template <class T>
void expect_near(const std::vector<T>& got, const Vec& ref, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double scale = 1.0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double e = std::fabs(as_double(got[i]) - ref[i]);
    if (std::isnan(e)) e = std::numeric_limits<double>::infinity();
    if (e > worst) worst = e, at = i;
  }
  EXPECT_LE(worst, rel * scale) << what << ": worst element [" << at << "] got " << as_double(got[at])
                                << ", reference " << ref[at] << " (scale " << scale << ", tolerance " << rel * scale
                                << ")";
}

inline Vec plus(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

// Runs f and checks that it throws xirang::Error of `kind` whose message
// contains every string in `parts` (the op name, the offending tensor, ...).
inline void expect_error(const std::function<void()>& f, ErrorKind kind, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an error of kind " << error_kind_name(kind) << ", nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << "message: " << e.what();
    for (auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

// ---------------------------------------------------------------- matmul / linear
// out (M, N) = alpha op(a) op(b) + beta out; a is (M, K) or, transposed, (K, M);
// b is (K, N) or, transposed, (N, K).
inline void ref_matmul(Vec& out, const Vec& a, const Vec& b, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                       double alpha, double beta) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += (ta ? a[k * M + i] : a[i * K + k]) * (tb ? b[j * K + k] : b[k * N + j]);
      out[i * N + j] = alpha * s + beta * out[i * N + j];
    }
}

// y (N, out) = x (N, in) w (out, in)^T + bias; bias empty means none.
inline Vec ref_linear_forward(const Vec& x, const Vec& w, const Vec& bias, int64_t N, int64_t in, int64_t out) {
  Vec y(N * out);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double s = bias.empty() ? 0.0 : bias[o];
      for (int64_t i = 0; i < in; ++i) s += x[n * in + i] * w[o * in + i];
      y[n * out + o] = s;
    }
  return y;
}

struct LinearGrads {
  Vec dx, dw, db;  // (N, in), (out, in), (out): the gradients alone, not accumulated
};

inline LinearGrads ref_linear_backward(const Vec& dy, const Vec& x, const Vec& w, int64_t N, int64_t in, int64_t out) {
  LinearGrads g{Vec(N * in, 0.0), Vec(out * in, 0.0), Vec(out, 0.0)};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double d = dy[n * out + o];
      g.db[o] += d;
      for (int64_t i = 0; i < in; ++i) {
        g.dx[n * in + i] += d * w[o * in + i];
        g.dw[o * in + i] += d * x[n * in + i];
      }
    }
  return g;
}

// ---------------------------------------------------------------- layernorm
constexpr double kEps = 1e-5;  // kLayerNormEps, restated so a change to it shows here

struct LayerNormOut {
  Vec y, mean, rstd;  // (N, C), (N), (N)
};

// Biased variance, computed two-pass from the mean.
inline LayerNormOut ref_layernorm_forward(const Vec& x, const Vec& w, const Vec& b, int64_t N, int64_t C) {
  LayerNormOut r{Vec(N * C), Vec(N), Vec(N)};
  for (int64_t n = 0; n < N; ++n) {
    const double* xr = &x[n * C];
    double m = 0;
    for (int64_t c = 0; c < C; ++c) m += xr[c];
    m /= double(C);
    double var = 0;
    for (int64_t c = 0; c < C; ++c) var += (xr[c] - m) * (xr[c] - m);
    var /= double(C);
    double rs = 1.0 / std::sqrt(var + kEps);
    r.mean[n] = m;
    r.rstd[n] = rs;
    for (int64_t c = 0; c < C; ++c) r.y[n * C + c] = (xr[c] - m) * rs * w[c] + b[c];
  }
  return r;
}

struct LayerNormGrads {
  Vec dx, dw, db;  // (N, C), (C), (C): gradients alone
};

// With xhat = (x - mean) rstd and g = dy * w, differentiating through mean
// and rstd gives dx = rstd (g - mean_c(g) - xhat mean_c(g xhat)).
inline LayerNormGrads ref_layernorm_backward(const Vec& dy, const Vec& x, const Vec& w, int64_t N, int64_t C) {
  Vec ones(C, 1.0), zeros(C, 0.0);
  LayerNormOut st = ref_layernorm_forward(x, ones, zeros, N, C);  // y = xhat
  LayerNormGrads g{Vec(N * C), Vec(C, 0.0), Vec(C, 0.0)};
  for (int64_t n = 0; n < N; ++n) {
    double mg = 0, mgx = 0;
    for (int64_t c = 0; c < C; ++c) {
      double gc = dy[n * C + c] * w[c];
      mg += gc;
      mgx += gc * st.y[n * C + c];
      g.dw[c] += dy[n * C + c] * st.y[n * C + c];
      g.db[c] += dy[n * C + c];
    }
    mg /= double(C);
    mgx /= double(C);
    for (int64_t c = 0; c < C; ++c)
      g.dx[n * C + c] = st.rstd[n] * (dy[n * C + c] * w[c] - mg - st.y[n * C + c] * mgx);
  }
  return g;
}

// ---------------------------------------------------------------- GELU (tanh form)
constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

inline double ref_gelu(double x) { return 0.5 * x * (1.0 + std::tanh(kGeluK * (x + kGeluA * x * x * x))); }

// d/dx of 0.5 x (1 + tanh u), u = k (x + a x^3):
// 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 a x^2).
inline double ref_gelu_grad(double x) {
  double t = std::tanh(kGeluK * (x + kGeluA * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kGeluK * (1.0 + 3.0 * kGeluA * x * x);
}

// ---------------------------------------------------------------- attention
// qkv (B, T, 3C): per token [q heads | k heads | v heads], head h at columns
// h*D .. h*D+D-1 of each third. probs (B, H, T, T), zero above the diagonal.
struct AttentionOut {
  Vec out, probs;  // (B, T, C), (B, H, T, T)
};

inline AttentionOut ref_attention_forward(const Vec& qkv, int64_t B, int64_t T, int64_t C, int64_t H) {
  const int64_t D = C / H, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(D));
  AttentionOut r{Vec(B * T * C, 0.0), Vec(B * H * T * T, 0.0)};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const double* q = &qkv[(b * T + t) * C3 + h * D];
        double* p = &r.probs[((b * H + h) * T + t) * T];
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t s = 0; s <= t; ++s) {
          const double* k = &qkv[(b * T + s) * C3 + C + h * D];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          p[s] = dot * scale;
          mx = std::max(mx, p[s]);
        }
        double z = 0;
        for (int64_t s = 0; s <= t; ++s) z += (p[s] = std::exp(p[s] - mx));
        for (int64_t s = 0; s <= t; ++s) p[s] /= z;
        double* o = &r.out[(b * T + t) * C + h * D];
        for (int64_t s = 0; s <= t; ++s) {
          const double* v = &qkv[(b * T + s) * C3 + 2 * C + h * D];
          for (int64_t d = 0; d < D; ++d) o[d] += p[s] * v[d];
        }
      }
  return r;
}

// Backward, derived by hand. For one (b, h, t) row with p = softmax(S),
// S_s = scale q_t . k_s, o_t = sum_s p_s v_s:
//   dv_s += p_s do_t;  dp_s = do_t . v_s;  dS_s = p_s (dp_s - sum_r p_r dp_r);
//   dq_t += scale sum_s dS_s k_s;  dk_s += scale dS_s q_t.
inline Vec ref_attention_backward(const Vec& dout, const Vec& qkv, int64_t B, int64_t T, int64_t C, int64_t H) {
  const int64_t D = C / H, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(D));
  AttentionOut fw = ref_attention_forward(qkv, B, T, C, H);
  Vec dqkv(B * T * C3, 0.0), dp(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const double* p = &fw.probs[((b * H + h) * T + t) * T];
        const double* dot = &dout[(b * T + t) * C + h * D];
        const double* q = &qkv[(b * T + t) * C3 + h * D];
        double* dq = &dqkv[(b * T + t) * C3 + h * D];
        double pdp = 0;
        for (int64_t s = 0; s <= t; ++s) {
          const double* v = &qkv[(b * T + s) * C3 + 2 * C + h * D];
          double* dv = &dqkv[(b * T + s) * C3 + 2 * C + h * D];
          dp[s] = 0;
          for (int64_t d = 0; d < D; ++d) {
            dp[s] += dot[d] * v[d];
            dv[d] += p[s] * dot[d];
          }
          pdp += p[s] * dp[s];
        }
        for (int64_t s = 0; s <= t; ++s) {
          double dS = p[s] * (dp[s] - pdp) * scale;
          const double* k = &qkv[(b * T + s) * C3 + C + h * D];
          double* dk = &dqkv[(b * T + s) * C3 + C + h * D];
          for (int64_t d = 0; d < D; ++d) {
            dq[d] += dS * k[d];
            dk[d] += dS * q[d];
          }
        }
      }
  return dqkv;
}

// ---------------------------------------------------------------- cross entropy
struct CrossEntropyOut {
  Vec losses, dlogits;  // (N), (N, Vp)
};

// Only columns [0, V) of each Vp-wide row take part; padding gradients are 0.
inline CrossEntropyOut ref_cross_entropy(const Vec& logits, const std::vector<int32_t>& targets, int64_t N, int64_t Vp,
                                         int64_t V, double dloss) {
  CrossEntropyOut r{Vec(N), Vec(N * Vp, 0.0)};
  for (int64_t n = 0; n < N; ++n) {
    const double* l = &logits[n * Vp];
    double mx = *std::max_element(l, l + V);
    double z = 0;
    for (int64_t j = 0; j < V; ++j) z += std::exp(l[j] - mx);
    double lse = mx + std::log(z);
    r.losses[n] = lse - l[targets[n]];
    for (int64_t j = 0; j < V; ++j)
      r.dlogits[n * Vp + j] = (std::exp(l[j] - lse) - (j == targets[n] ? 1.0 : 0.0)) * dloss;
  }
  return r;
}

// ---------------------------------------------------------------- embedding
// out (B, T, C) = wte[tokens] + wpe[t].
inline Vec ref_embedding_forward(const std::vector<int32_t>& tokens, const Vec& wte, const Vec& wpe, int64_t B,
                                 int64_t T, int64_t C) {
  Vec out(B * T * C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c)
        out[(b * T + t) * C + c] = wte[int64_t(tokens[b * T + t]) * C + c] + wpe[t * C + c];
  return out;
}

// Adds the embedding gradients to dwte (V, C) and dwpe (>= T, C).
inline void ref_embedding_backward(Vec& dwte, Vec& dwpe, const Vec& dout, const std::vector<int32_t>& tokens, int64_t B,
                                   int64_t T, int64_t C) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        double d = dout[(b * T + t) * C + c];
        dwte[int64_t(tokens[b * T + t]) * C + c] += d;
        dwpe[t * C + c] += d;
      }
}

// Rows of a vocabulary shard wte (V_shard, C) holding global rows
// [vocab_begin, vocab_begin + V_shard): out (N, C) is the token's row, or zeros
// for a token the shard does not hold.
inline Vec ref_embedding_lookup(const std::vector<int32_t>& tokens, const Vec& wte, int64_t vocab_begin,
                                int64_t shard_rows, int64_t C) {
  Vec out(tokens.size() * C, 0.0);
  for (size_t i = 0; i < tokens.size(); ++i) {
    int64_t r = tokens[i] - vocab_begin;
    if (r < 0 || r >= shard_rows) continue;
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = wte[r * C + c];
  }
  return out;
}

// Row i of a run of N rows starting at flattened row `row_offset` of
// (B * seq_len) rows sits at position (row_offset + i) % seq_len.
inline Vec ref_add_positions(const Vec& x, const Vec& wpe, int64_t N, int64_t C, int64_t seq_len, int64_t row_offset) {
  Vec y = x;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) y[i * C + c] += wpe[((row_offset + i) % seq_len) * C + c];
  return y;
}

// Adds the position gradients of those rows to dwpe (>= seq_len, C).
inline void ref_add_positions_backward(Vec& dwpe, const Vec& dx, int64_t N, int64_t C, int64_t seq_len,
                                       int64_t row_offset) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) dwpe[((row_offset + i) % seq_len) * C + c] += dx[i * C + c];
}

// ---------------------------------------------------------------- AdamW
struct AdamWRef {
  double lr, beta1, beta2, eps, weight_decay, grad_scale;
};

// One step t (1-based) on p, m, v in place: decoupled weight decay applied
// to the parameter before the update, bias-corrected moments.
inline void ref_adamw(Vec& p, Vec& m, Vec& v, const Vec& grad, const AdamWRef& s, int64_t t) {
  const double c1 = 1.0 - std::pow(s.beta1, double(t)), c2 = 1.0 - std::pow(s.beta2, double(t));
  for (size_t i = 0; i < p.size(); ++i) {
    double g = grad[i] * s.grad_scale;
    m[i] = s.beta1 * m[i] + (1.0 - s.beta1) * g;
    v[i] = s.beta2 * v[i] + (1.0 - s.beta2) * g * g;
    double mhat = m[i] / c1, vhat = v[i] / c2;
    p[i] -= s.lr * (mhat / (std::sqrt(vhat) + s.eps) + s.weight_decay * p[i]);
  }
}

// ---------------------------------------------------------------- casts and reductions
// Rounds x to the nearest value with `bits` significant bits (ties to even),
// which is what bf16 (8 bits) and f16 (11 bits) store for normal numbers.
// frexp gives x = f 2^e with f in [0.5, 1); nearbyint rounds ties to even
// under the default rounding mode.
inline double ref_round_bits(double x, int bits) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e;
  double f = std::frexp(x, &e);
  return std::ldexp(std::nearbyint(std::ldexp(f, bits)), e - bits);
}
inline double ref_round_bf16(double x) { return ref_round_bits(double(float(x)), 8); }
inline double ref_round_f16(double x) { return ref_round_bits(double(float(x)), 11); }  // |x| in [2^-14, 65504]

// A 16-bit output computed in float (or double) from exact inputs and
// rounded once equals the reference rounded to S, except where the reference
// lies within the float error of a rounding boundary: a fraction of about
// (float error) / (16-bit spacing), well under 1% for the sizes here. Rounding
// twice, or accumulating in 16 bits, misses far more often. Elements below
// f16's normal range (2^-14) are not counted.
template <class S>
void expect_mostly_rounded(const std::vector<S>& got, const Vec& ref, double min_fraction, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t counted = 0, exact = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::fabs(ref[i]) < 0x1p-14) continue;
    ++counted;
    double want = std::is_same_v<S, bf16> ? ref_round_bf16(ref[i]) : ref_round_f16(ref[i]);
    exact += as_double(got[i]) == want;
  }
  ASSERT_GT(counted, 0u) << what;
  EXPECT_GE(double(exact) / double(counted), min_fraction)
      << what << ": " << exact << " of " << counted << " elements are the reference rounded to "
      << (std::is_same_v<S, bf16> ? "bf16" : "f16");
}

// Reinterpreted bytes, for bitwise comparisons of any storage type.
template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// y (N, C) + bias (C) on every row.
inline Vec ref_add_bias(const Vec& y, const Vec& bias, int64_t N, int64_t C) {
  Vec r = y;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) r[n * C + c] += bias[c];
  return r;
}

inline double ref_sum_squares(const Vec& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return s;
}

}  // namespace xirang::test
