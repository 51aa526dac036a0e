// Tests for kernels/attention.h (causal multi-head self-attention) against
// the float64 reference, plus a finite-difference check of the F64 backward.
//
// fp32 tolerance: 1e-5 of max(1, max|ref|). Scores are D = 16 term dot
// products of unit-scale values scaled by 1/4, the softmax spans <= 13
// entries and each output sums <= 13 weighted values: every stage is a short
// sum, so errors stay ~1e-6 of the scale.
#include <array>
#include <cmath>

#include "kernels/attention.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr double kTolF32 = 1e-5;

template <class T>
class AttentionTest : public ::testing::Test {
 protected:
  static constexpr int64_t B = 2, T_ = 13, C = 48, H = 3;
  KernelContext ctx;
  std::vector<T> qkv = cast_vec<T>(randn(B * T_ * 3 * C, 301));
  std::vector<T> dout = cast_vec<T>(randn(B * T_ * C, 302));

  // Kernel forward into outputs pre-filled with random values, so entries the
  // kernel forgets to write (the masked upper triangle) show.
  void forward(std::vector<T>& out, std::vector<T>& probs) {
    out = cast_vec<T>(randn(B * T_ * C, 303));
    probs = cast_vec<T>(randn(B * H * T_ * T_, 304));
    attention_forward(ctx, view(out, {B, T_, C}), view(probs, {B, H, T_, T_}), view(qkv, {B, T_, 3 * C}), int(H));
  }
};
using ComputeTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AttentionTest, ComputeTypes);

TYPED_TEST(AttentionTest, Forward) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t B = f.B, Tn = f.T_, H = f.H;
  std::vector<T> out, probs;
  f.forward(out, probs);
  AttentionOut r = ref_attention_forward(to_f64(f.qkv), B, Tn, f.C, H);
  expect_near(out, r.out, tol<T>(kTolF32), "out");
  expect_near(probs, r.probs, tol<T>(kTolF32), "probs");
  // Above the diagonal: exactly zero, not merely small (backward may sum
  // whole rows). Each row sums to one.
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < Tn; ++t) {
      double sum = 0;
      for (int64_t s = 0; s < Tn; ++s) {
        T p = probs[(bh * Tn + t) * Tn + s];
        if (s > t) {
          ASSERT_EQ(p, T(0)) << "probs[" << bh << ", " << t << ", " << s << "] above the diagonal";
        }
        sum += double(p);
      }
      ASSERT_NEAR(sum, 1.0, tol<T>(1e-6)) << "row " << bh << ", " << t;
    }
}

// The first token attends only to itself: its output is its own value vector
// for every head, whatever q and k are. A direct check of the causal mask
// and of the q | k | v column layout.
TYPED_TEST(AttentionTest, FirstTokenOutputIsItsValue) {
  using T = TypeParam;
  auto& f = *this;
  std::vector<T> out, probs;
  f.forward(out, probs);
  for (int64_t b = 0; b < f.B; ++b)
    for (int64_t c = 0; c < f.C; ++c)
      EXPECT_NEAR(double(out[(b * f.T_) * f.C + c]), double(f.qkv[(b * f.T_) * 3 * f.C + 2 * f.C + c]), tol<T>(1e-6))
          << "b " << b << " c " << c;
}

// dqkv is overwritten (pre-filled with random values here); the kernel's
// probs from its own forward are passed, as the model does.
TYPED_TEST(AttentionTest, Backward) {
  using T = TypeParam;
  auto& f = *this;
  const int64_t B = f.B, Tn = f.T_, C = f.C, H = f.H;
  std::vector<T> out, probs;
  f.forward(out, probs);
  auto dqkv = cast_vec<T>(randn(B * Tn * 3 * C, 305));
  attention_backward(f.ctx, view(dqkv, {B, Tn, 3 * C}), view(f.dout, {B, Tn, C}), view(f.qkv, {B, Tn, 3 * C}),
                     view(probs, {B, H, Tn, Tn}), int(H));
  Vec ref = ref_attention_backward(to_f64(f.dout), to_f64(f.qkv), B, Tn, C, H);
  // Compare q, k and v parts separately so a failure says which one.
  const char* part[] = {"dq", "dk", "dv"};
  for (int64_t p = 0; p < 3; ++p) {
    std::vector<T> got;
    Vec want;
    for (int64_t i = 0; i < B * Tn; ++i)
      for (int64_t c = 0; c < C; ++c) {
        got.push_back(dqkv[i * 3 * C + p * C + c]);
        want.push_back(ref[i * 3 * C + p * C + c]);
      }
    expect_near(got, want, tol<T>(kTolF32), part[p]);
  }
}

// One head (H = 1) and T = 1 are edge cases of the indexing; check both.
TYPED_TEST(AttentionTest, SingleHeadAndSingleToken) {
  using T = TypeParam;
  KernelContext ctx;
  for (auto [B, Tn, C, H] : {std::array<int64_t, 4>{3, 7, 8, 1}, std::array<int64_t, 4>{2, 1, 12, 4}}) {
    SCOPED_TRACE(testing::Message() << "B " << B << " T " << Tn << " C " << C << " H " << H);
    auto qkv = cast_vec<T>(randn(B * Tn * 3 * C, 311));
    auto dout = cast_vec<T>(randn(B * Tn * C, 312));
    auto out = cast_vec<T>(randn(B * Tn * C, 313));
    auto probs = cast_vec<T>(randn(B * H * Tn * Tn, 314));
    auto dqkv = cast_vec<T>(randn(B * Tn * 3 * C, 315));
    attention_forward(ctx, view(out, {B, Tn, C}), view(probs, {B, H, Tn, Tn}), view(qkv, {B, Tn, 3 * C}), int(H));
    attention_backward(ctx, view(dqkv, {B, Tn, 3 * C}), view(dout, {B, Tn, C}), view(qkv, {B, Tn, 3 * C}),
                       view(probs, {B, H, Tn, Tn}), int(H));
    AttentionOut r = ref_attention_forward(to_f64(qkv), B, Tn, C, H);
    expect_near(out, r.out, tol<T>(kTolF32), "out");
    expect_near(probs, r.probs, tol<T>(kTolF32), "probs");
    expect_near(dqkv, ref_attention_backward(to_f64(dout), to_f64(qkv), B, Tn, C, H), tol<T>(kTolF32), "dqkv");
  }
}

// Central differences on L = sum(out * R) in float64 against the kernel's F64
// backward with dout = R, over every element of qkv. h = 1e-6: truncation
// ~1e-12, roundoff ~1e-16 |L| / h ~ 1e-9; the norm-wise bound is 1e-6.
TEST(AttentionGradCheck, FiniteDifferences) {
  const int64_t B = 2, Tn = 5, C = 12, H = 3;
  const double h = 1e-6;
  KernelContext ctx;
  Vec qkv = randn(B * Tn * 3 * C, 321), R = randn(B * Tn * C, 322);
  Vec out(B * Tn * C), probs(B * H * Tn * Tn);
  auto loss = [&]() {
    attention_forward(ctx, view(out, {B, Tn, C}), view(probs, {B, H, Tn, Tn}), view(qkv, {B, Tn, 3 * C}), int(H));
    double L = 0;
    for (size_t i = 0; i < out.size(); ++i) L += out[i] * R[i];
    return L;
  };
  loss();
  Vec dqkv(qkv.size());
  attention_backward(ctx, view(dqkv, {B, Tn, 3 * C}), view(R, {B, Tn, C}), view(qkv, {B, Tn, 3 * C}),
                     view(probs, {B, H, Tn, Tn}), int(H));
  EXPECT_LT(normwise_error(numeric_gradient(qkv, h, loss), dqkv), 1e-6);
}

TEST(AttentionErrors, WrongQkvWidthNamesTheOp) {
  KernelContext ctx;
  const int64_t B = 1, Tn = 4, C = 12;
  std::vector<float> qkv(B * Tn * (3 * C + 1)), out(B * Tn * C), probs(B * 3 * Tn * Tn);
  expect_error([&] {
    attention_forward(ctx, view(out, {B, Tn, C}), view(probs, {B, 3, Tn, Tn}), view(qkv, {B, Tn, 3 * C + 1}), 3);
  }, ErrorKind::Shape, {"attention"});
}

TEST(AttentionErrors, WrongProbsShapeNamesTheOp) {
  KernelContext ctx;
  const int64_t B = 1, Tn = 4, C = 12;
  std::vector<float> qkv(B * Tn * 3 * C), out(B * Tn * C), probs(B * 2 * Tn * Tn);
  expect_error([&] {
    attention_forward(ctx, view(out, {B, Tn, C}), view(probs, {B, 2, Tn, Tn}), view(qkv, {B, Tn, 3 * C}), 3);
  }, ErrorKind::Shape, {"attention"});
}

// C not divisible by the head count: any xirang::Error naming the op (the
// header does not fix whether this is a shape or a usage error).
TEST(AttentionErrors, HeadsMustDivideChannels) {
  KernelContext ctx;
  const int64_t B = 1, Tn = 4, C = 10;
  std::vector<float> qkv(B * Tn * 3 * C), out(B * Tn * C), probs(B * 3 * Tn * Tn);
  try {
    attention_forward(ctx, view(out, {B, Tn, C}), view(probs, {B, 3, Tn, Tn}), view(qkv, {B, Tn, 3 * C}), 3);
    ADD_FAILURE() << "C = 10 with 3 heads was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attention"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace xirang::test
