// CUDA elementwise ops, casts and reductions against the CPU ops in f64.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|:
// - One rounded store of an exactly computed value (add, add_bias): rtol =
//   u_S, the storage dtype's unit roundoff, plus 2^-23 for the float
//   intermediate (a sum of two 16-bit values can round once in float
//   first). atol 1e-30 only absorbs exact zeros.
// - scale: both sides form the product in double and round once
//   (kernels/elementwise.h), so it is compared bit for bit with the CPU op
//   run in the same dtype, besides the f64 check.
// - GELU: the float evaluation (tanhf and a few products, a handful of ulps)
//   adds about 1e-6 relative. Where tanh is near -1 or 1 the terms 1 + t and
//   1 - t^2 keep only an absolute accuracy of a few 2^-24: forward that
//   costs 0.5 |x| * 1.2e-7 < 1e-6 (atol 2e-6); the derivative multiplies
//   1 - t^2 by 0.5 |x| k (1 + 3 a x^2), about 8 where the loss peaks (|x| near
//   5, before tanh saturates in float), times |dy| <= 4: atol 1e-5. Storage
//   rounding adds u_S relative. A wrong constant or formula is off by 1e-3
//   or more.
// - sum_squares: both sides add exact squares in double; only the order
//   differs (relative 1e-16 per addition): rtol = 1e-12 (sum_squares_group:
//   the bound is worked out at its test).
// - cast: round to nearest even on both sides, so values must be identical.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/elementwise.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

constexpr double kFloatSlack = 0x1p-23;

class ElementwiseTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(ElementwiseTest);

// Over a million elements, so the grid-stride loops wrap at least once.
TEST_P(ElementwiseTest, GeluForward) {
  const DType S = GetParam();
  HostTensor x = random_host({1031, 1019}, S, 1, 2.0);
  DeviceTensor dx = to_device(x), dy(x.shape(), S);
  cuda::gelu_forward(ctx(), dy, dx);
  HostTensor ref(x.shape(), DType::F64);
  gelu_forward(cpu(), ref, host_cast(x, DType::F64));
  expect_close(to_host(dy), ref, 2e-6, unit_roundoff(S) + 1e-6, "gelu y");
}

// Separate output, then in place (dx aliasing dy, as the header allows).
TEST_P(ElementwiseTest, GeluBackward) {
  const DType S = GetParam();
  HostTensor x = random_host({37, 29}, S, 2, 2.0), dy = random_host({37, 29}, S, 3);
  HostTensor ref(x.shape(), DType::F64);
  gelu_backward(cpu(), ref, host_cast(dy, DType::F64), host_cast(x, DType::F64));
  DeviceTensor dx_dev = to_device(x), dy_dev = to_device(dy), out(x.shape(), S);
  cuda::gelu_backward(ctx(), out, dy_dev, dx_dev);
  expect_close(to_host(out), ref, 1e-5, unit_roundoff(S) + 1e-6, "gelu dx");
  cuda::gelu_backward(ctx(), dy_dev, dy_dev, dx_dev);
  expect_close(to_host(dy_dev), ref, 1e-5, unit_roundoff(S) + 1e-6, "gelu dx in place");
}

// A (B, T, C) activation: every leading dimension is a row.
TEST_P(ElementwiseTest, AddBias) {
  const DType S = GetParam();
  HostTensor y = random_host({3, 5, 37}, S, 4), bias = random_host({37}, S, 5);
  HostTensor ref = host_cast(y, DType::F64);
  add_bias(cpu(), ref, host_cast(bias, DType::F64));
  DeviceTensor y_dev = to_device(y), b_dev = to_device(bias);
  cuda::add_bias(ctx(), y_dev, b_dev);
  expect_close(to_host(y_dev), ref, 1e-30, unit_roundoff(S) + kFloatSlack, "add_bias");
}

TEST_P(ElementwiseTest, AddIntoOperand) {
  const DType S = GetParam();
  HostTensor a = random_host({41, 23}, S, 6), b = random_host({41, 23}, S, 7);
  HostTensor ref(a.shape(), DType::F64);
  add(cpu(), ref, host_cast(a, DType::F64), host_cast(b, DType::F64));
  DeviceTensor a_dev = to_device(a), b_dev = to_device(b), out(a.shape(), S);
  cuda::add(ctx(), out, a_dev, b_dev);
  expect_close(to_host(out), ref, 1e-30, unit_roundoff(S) + kFloatSlack, "add");
  cuda::add(ctx(), a_dev, a_dev, b_dev);  // out aliasing a
  expect_close(to_host(a_dev), ref, 1e-30, unit_roundoff(S) + kFloatSlack, "add in place");
}

TEST_P(ElementwiseTest, ScaleAndZero) {
  const DType S = GetParam();
  HostTensor x = random_host({1001}, S, 8);
  HostTensor ref = host_cast(x, DType::F64), same = host_cast(x, S);
  scale(cpu(), ref, -0.37);
  scale(cpu(), same, -0.37);
  DeviceTensor x_dev = to_device(x);
  cuda::scale(ctx(), x_dev, -0.37);
  HostTensor got = to_host(x_dev);
  expect_close(got, ref, 1e-30, unit_roundoff(S) + 0x1p-50, "scale");  // + the double product's rounding
  expect_equal(got, same, "scale against the CPU in the same dtype");
  cuda::zero(ctx(), x_dev);
  HostTensor zeros(x.shape(), S);  // HostTensor starts zeroed
  expect_equal(to_host(x_dev), zeros, "zero");
}

// Values from f16 subnormals to beyond the f16 range, plus inf and NaN, so
// the roundings, overflow to inf and NaN propagation are all exercised.
// Here the parameter is the source dtype; each test covers every target.
TEST_P(ElementwiseTest, CastToEveryDType) {
  const DType in = GetParam();
  std::vector<double> v = values(random_host({997}, DType::F64, 9));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::ldexp(v[i], int(i % 41) - 26);  // 2^-26 .. 2^14
  v[0] = std::numeric_limits<double>::infinity();
  v[1] = -std::numeric_limits<double>::infinity();
  v[2] = std::numeric_limits<double>::quiet_NaN();
  v[3] = 70000.0;  // overflows f16
  HostTensor x = host_from(v, {997}, in);
  DeviceTensor x_dev = to_device(x);
  for (DType out : {DType::F32, DType::BF16, DType::F16}) {
    HostTensor ref(x.shape(), out);
    cast(cpu(), ref, x);
    DeviceTensor y(x.shape(), out);
    cuda::cast(ctx(), y, x_dev);
    expect_equal(to_host(y), ref, std::string("cast ") + dtype_name(in) + " -> " + dtype_name(out));
  }
}

// Large enough for the first pass's full grid; repeated calls must agree bit
// for bit (the partition depends on the element count only).
TEST_P(ElementwiseTest, SumSquares) {
  const DType S = GetParam();
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(3000017)}) {
    HostTensor x = random_host({n}, S, 10 + uint64_t(n));
    const double ref = sum_squares(cpu(), host_cast(x, DType::F64));
    DeviceTensor x_dev = to_device(x);
    const double got = cuda::sum_squares(ctx(), x_dev);
    EXPECT_NEAR(got, ref, 1e-12 * ref) << "n = " << n;
    EXPECT_EQ(cuda::sum_squares(ctx(), x_dev), got) << "n = " << n << ": not reproducible";
  }
  DeviceTensor empty({0}, S);
  EXPECT_EQ(cuda::sum_squares(ctx(), empty), 0.0);
}

// The grouped sum of squares (the gradient norm's one reduction) over
// several tensors of odd sizes, over four million elements in all, against
// the f64 CPU op summed per tensor. Both sides add exact squares in double
// and differ only in order: the GPU's sum of one element passes through at
// most ~150 roundings (128 in a thread, 8 + 10 tree levels, a few partials
// per final thread), the CPU's at most ~4,300 (4,096 in a lane, its tree,
// ~130 chunks), each relative 2^-53 on positive terms, so they agree within
// 5e-13 relative: rtol 1e-12, while one element left out or counted twice
// moves the sum by ~1e-7. A second run gives the same bits, and so does a
// table written afresh.
TEST_P(ElementwiseTest, SumSquaresGroup) {
  const DType S = GetParam();
  const std::vector<int64_t> sizes{1, 7, 1000, 4099, 3000017, 1048583};
  std::vector<DeviceTensor> dev;
  double ref = 0;
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    HostTensor x = random_host({sizes[i]}, S, 40 + uint64_t(i));
    ref += sum_squares(cpu(), host_cast(x, DType::F64));
    dev.push_back(to_device(x));
    total += sizes[i];
  }
  std::vector<Tensor> xs(dev.begin(), dev.end());
  DeviceTensor mem({group_table_words(int64_t(xs.size()), total)}, DType::U32), out({1}, DType::F64);
  GroupTable table(mem);
  double got[2] = {0, 0};
  for (double& g : got) {
    cuda::sum_squares_group(ctx(), out, xs, table);
    g = values(to_host(out))[0];
  }
  EXPECT_NEAR(got[0], ref, 1e-12 * ref);
  EXPECT_EQ(got[1], got[0]) << "not reproducible";
  GroupTable fresh(mem);
  cuda::sum_squares_group(ctx(), out, xs, fresh);
  EXPECT_EQ(values(to_host(out))[0], got[0]) << "a rewritten table changed the sum";
  // A subset rewrites the table; no tensors give 0.
  const double last = sum_squares(cpu(), host_cast(to_host(xs.back()), DType::F64));
  cuda::sum_squares_group(ctx(), out, std::vector<Tensor>(xs.begin(), xs.end() - 1), table);
  EXPECT_NEAR(values(to_host(out))[0], ref - last, 1e-12 * ref);
  cuda::sum_squares_group(ctx(), out, {}, table);
  EXPECT_EQ(values(to_host(out))[0], 0.0);
}

// The accumulating forms leave the sum on the device: two tensors added to
// a running sum give the f64 reference within the same bound, and the
// squares' sum repeats bit for bit.
TEST_P(ElementwiseTest, AccumulatingSums) {
  const DType S = GetParam();
  HostTensor a = random_host({1000}, S, 21), b = random_host({3000017}, S, 22);
  const double ref = 0.75 + sum_squares(cpu(), host_cast(a, DType::F64)) + sum_squares(cpu(), host_cast(b, DType::F64));
  DeviceTensor a_dev = to_device(a), b_dev = to_device(b);
  double got[2] = {0, 0};
  for (double& g : got) {
    DeviceTensor acc = to_device(host_from({0.75}, {1}, DType::F64));
    cuda::sum_squares_accumulate(ctx(), acc, a_dev);
    cuda::sum_squares_accumulate(ctx(), acc, b_dev);
    g = values(to_host(acc))[0];
  }
  EXPECT_NEAR(got[0], ref, 1e-12 * ref);
  EXPECT_EQ(got[1], got[0]) << "not reproducible";
  if (S == DType::F32) {  // the losses the model keeps
    std::vector<double> va = values(a), vb = values(b);
    double ma = 0, mb = 0;
    for (double x : va) ma += x;
    for (double x : vb) mb += x;
    DeviceTensor acc = to_device(host_from({-2.0}, {1}, DType::F64));
    cuda::mean_accumulate(ctx(), acc, a_dev);
    cuda::mean_accumulate(ctx(), acc, b_dev);
    EXPECT_NEAR(values(to_host(acc))[0], -2.0 + ma / 1000 + mb / 3000017, 1e-12);
  }
}

TEST_P(ElementwiseTest, AllFinite) {
  const DType S = GetParam();
  std::vector<double> v = values(random_host({5003}, DType::F64, 11));
  EXPECT_TRUE(cuda::all_finite(ctx(), to_device(host_from(v, {5003}, S))));
  for (double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    std::vector<double> w = v;
    w[4999] = bad;
    EXPECT_FALSE(cuda::all_finite(ctx(), to_device(host_from(w, {5003}, S)))) << "with " << bad;
  }
}

}  // namespace
}  // namespace xirang::test
