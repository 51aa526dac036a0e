// Tests for core/tensor.h (Shape, Tensor views and slices, shape checks) and
// core/dtype.h (sizes, names, parsing, 16-bit float conversions).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "tests/support/expect_error.h"
#include "core/tensor.h"

namespace xirang {
namespace {

TEST(Shape, RankNumelAndText) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s[1], 3);
  EXPECT_EQ(s.str(), "(2, 3, 4)");
  EXPECT_EQ(Shape{}.numel(), 1);  // a scalar holds one element
  EXPECT_EQ(Shape{}.str(), "()");
  EXPECT_EQ((Shape{5, 0}).numel(), 0);
}

TEST(Shape, EqualityComparesRankAndDims) {
  EXPECT_EQ((Shape{2, 3}), (Shape{2, 3}));
  EXPECT_NE((Shape{2, 3}), (Shape{3, 2}));
  EXPECT_NE((Shape{6}), (Shape{6, 1}));  // same numel, different rank
  Shape s;
  s.push_back(2);
  s.push_back(3);
  EXPECT_EQ(s, (Shape{2, 3}));
}

TEST(Shape, RankAboveMaximumThrows) {
  Shape s{1, 2, 3, 4, 5, 6};
  EXPECT_THROW(s.push_back(7), Error);
  EXPECT_THROW((Shape{1, 2, 3, 4, 5, 6, 7}), Error);
}

class TensorViews : public ::testing::Test {
 protected:
  std::vector<float> buf = std::vector<float>(2 * 3 * 4);
  Tensor t{buf.data(), {2, 3, 4}, DType::F32};
  void SetUp() override { std::iota(buf.begin(), buf.end(), 1.0f); }
};

TEST_F(TensorViews, BasicProperties) {
  EXPECT_TRUE(t.defined());
  EXPECT_FALSE(Tensor{}.defined());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.bytes(), 24u * 4);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.device(), Device::CPU);
  EXPECT_EQ(t.str(), "f32(2, 3, 4) cpu");
}

TEST_F(TensorViews, ViewsShareMemory) {
  Tensor v = t.view({6, 4});
  EXPECT_EQ(v.raw(), t.raw());
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_EQ(t.flat2d().shape(), (Shape{6, 4}));
  EXPECT_EQ(t.flat().shape(), (Shape{24}));
  EXPECT_EQ(t.flat().raw(), t.raw());
}

TEST_F(TensorViews, ViewWithOtherElementCountIsAShapeError) {
  expect_error([&] { t.view({5, 5}); }, ErrorKind::Shape, {"(2, 3, 4)", "(5, 5)"});
}

// slice(b, e) takes rows [b, e) of dimension 0: a (e - b, 3, 4) tensor that
// starts b * 12 elements in.
TEST_F(TensorViews, SliceSelectsRows) {
  Tensor s = t.slice(1, 2);
  EXPECT_EQ(s.shape(), (Shape{1, 3, 4}));
  EXPECT_EQ(s.data<float>(), buf.data() + 12);
  EXPECT_EQ(s.data<float>()[0], 13.0f);
  Tensor rows = t.flat2d().slice(2, 5);  // rows of the (6, 4) view
  EXPECT_EQ(rows.shape(), (Shape{3, 4}));
  EXPECT_EQ(rows.data<float>(), buf.data() + 8);
  EXPECT_EQ(t.slice(2, 2).numel(), 0);  // empty slice at the end is allowed
}

TEST_F(TensorViews, SliceOutOfBoundsThrows) {
  // XR_CHECK failures are internal errors (API misuse) whose message carries
  // the offending range and tensor.
  expect_error([&] { t.slice(1, 3); }, ErrorKind::Internal, {"slice [1, 3)", "(2, 3, 4)"});
  expect_error([&] { t.slice(-1, 1); }, ErrorKind::Internal, {"slice"});
  expect_error([&] { t.slice(2, 1); }, ErrorKind::Internal, {"slice"});
}

TEST_F(TensorViews, FlatRange) {
  Tensor r = t.flat_range(5, 9);
  EXPECT_EQ(r.shape(), (Shape{4}));
  EXPECT_EQ(r.data<float>()[0], 6.0f);
  expect_error([&] { t.flat_range(20, 25); }, ErrorKind::Internal, {"range [20, 25)"});
}

TEST_F(TensorViews, TypedAccessChecksDtype) {
  expect_error([&] { t.data<double>(); }, ErrorKind::Shape, {"f32(2, 3, 4)", "f64"});
}

TEST(ShapeChecks, MessagesNameOpAndTensor) {
  std::vector<float> a(6), b(6);
  Tensor x(a.data(), {2, 3}, DType::F32), y(b.data(), {3, 2}, DType::F32);
  expect_error([&] { check_same_shape("my_op", x, y); }, ErrorKind::Shape, {"my_op", "(2, 3)", "(3, 2)"});
  expect_error([&] { check_shape("my_op", "weight", x, {3, 2}); }, ErrorKind::Shape, {"my_op", "weight", "(3, 2)"});
  expect_error([&] { check_dtype("my_op", "bias", x, DType::BF16); }, ErrorKind::Shape, {"my_op", "bias", "bf16"});
  EXPECT_NO_THROW(check_same_shape("my_op", x, x));
}

// ---------------------------------------------------------------- dtype

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_STREQ(dtype_name(DType::BF16), "bf16");
  EXPECT_TRUE(is_float(DType::F16));
  EXPECT_FALSE(is_float(DType::I32));
}

TEST(DType, ParseAcceptsAliasesAndNamesTheKeyOnError) {
  EXPECT_EQ(parse_dtype("fp32", "k"), DType::F32);
  EXPECT_EQ(parse_dtype("bfloat16", "k"), DType::BF16);
  EXPECT_EQ(parse_dtype("float16", "k"), DType::F16);
  expect_error([] { parse_dtype("f8", "train.dtype"); }, ErrorKind::Config, {"train.dtype", "f8"});
}

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 is the top 16 bits of a float, rounded to nearest even.
TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3F80);
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3F808000)).bits, 0x3F80);  // tie, even mantissa stays
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3F818000)).bits, 0x3F82);  // tie, rounds up to even
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3F808001)).bits, 0x3F81);  // just above the tie
  EXPECT_EQ(float_to_bf16(-2.5f).bits, 0xC020);
  EXPECT_EQ(bf16_to_float(bf16{0x3F80}), 1.0f);
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(INFINITY))));
  // A NaN whose payload sits only in the low 16 bits must stay NaN, not become inf.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_to_float(0x7F800001)))));
  // The largest float rounds up past the largest bf16: overflow to inf, as IEEE rounding does.
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::max()))));
}

TEST(DType, F16RoundTripAndSpecials) {
  EXPECT_EQ(float_to_f16(1.0f).bits, 0x3C00);
  EXPECT_EQ(float_to_f16(-2.0f).bits, 0xC000);
  EXPECT_EQ(float_to_f16(65504.0f).bits, 0x7BFF);  // largest finite f16
  EXPECT_EQ(float_to_f16(1.0f + 0x1p-11f).bits, 0x3C00);  // tie to even
  EXPECT_EQ(float_to_f16(1.0f + 3 * 0x1p-11f).bits, 0x3C02);
  EXPECT_EQ(f16_to_float(f16{0x0001}), 0x1p-24f);  // smallest subnormal
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(1e6f))));
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(NAN))));
  // Every finite f16 survives f16 -> float -> f16 exactly.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7C00) == 0x7C00) continue;  // inf / NaN
    ASSERT_EQ(float_to_f16(f16_to_float(f16{uint16_t(b)})).bits, b) << std::hex << b;
  }
}

TEST(ErrorKinds, EveryKindHasAName) {
  EXPECT_STREQ(error_kind_name(ErrorKind::Shape), "shape error");
  EXPECT_STREQ(error_kind_name(ErrorKind::Memory), "memory error");
  Error e(ErrorKind::Config, "bad");
  EXPECT_EQ(e.kind(), ErrorKind::Config);
  EXPECT_STREQ(e.what(), "bad");
}

// XR_CHECK evaluates its condition exactly once and carries the expression text.
TEST(ErrorKinds, CheckEvaluatesOnceAndNamesTheExpression) {
  int calls = 0;
  auto once = [&] { return ++calls > 5; };
  expect_error([&] { XR_CHECK(once(), "value ", 42); }, ErrorKind::Internal, {"once()", "value 42"});
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace xirang
