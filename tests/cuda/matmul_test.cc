// CUDA matmul and linear layers (cuBLASLt) against the CPU ops in f64.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|:
// - atol = 2e-5 * scale, scale = max(1, max |ref|): the products here are
//   dot products of K <= 301 terms of unit-scale values accumulated in fp32
//   (16-bit inputs multiply exactly in fp32). The accumulation error grows
//   like sqrt(K) u_f32 |terms| (about 1e-6 of the scale for K = 301, blocked
//   and split sums included); 2e-5 leaves a 20x margin while a transpose,
//   leading-dimension or beta mistake is an O(1) error.
// - rtol = u_S for a 16-bit result: one rounding when stored (0 for f32,
//   where atol covers it).
// - GELU outputs get a per-element bound: y = gelu(pre) inherits pre's error
//   times |gelu'(pre)| <= 1.13, and where cuBLASLt's epilogue or the
//   unfused path evaluates gelu from a pre rounded to S that error is up to
//   u_S |pre| (bounded here by u_S * 1.13 |pre|), plus y's own rounding.
// - With a bias and 16-bit storage, cuBLASLt's bias epilogue may round the
//   product x w^T to S before the bias is added (seen on an H200, cuBLASLt
//   13: 7 bf16 ulps of the result where the product and the bias nearly
//   cancel), as PyTorch's fused addmm does too. Such an element's error is
//   then bounded by u_S |x w^T| + u_S |result|, so the bias cases take
//   rtol against |x w^T| + |ref| (expect_biased_product); the CPU adds the
//   bias in fp32 before its one rounding.
// - Products that read a stored 16-bit intermediate (dpre in the GELU
//   backward) are compared with the CPU op run on that stored intermediate,
//   so the tolerance above still applies; the intermediate itself is checked
//   against its own f64 reference.
#include <cmath>
#include <limits>
#include <string>

#include "kernels/cuda/ops.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

constexpr double kAccum = 2e-5;

double rtol_for(DType s) { return s == DType::F32 ? 0.0 : unit_roundoff(s); }

void expect_product(const Tensor& got, const Tensor& ref, DType stored, const std::string& what) {
  expect_close(got, ref, kAccum * scale_of(ref), rtol_for(stored), what);
}

// |got - ref| <= atol + rtol (|product| + |ref|) per element, product the
// f64 reference of x w^T without the bias (see the tolerance notes above).
void expect_biased_product(const Tensor& got, const Tensor& ref, const Tensor& product, DType stored,
                           const std::string& what) {
  const std::vector<double> g = values(got), r = values(ref), p = values(product);
  ASSERT_EQ(g.size(), r.size()) << what;
  const double atol = kAccum * scale_of(ref), rtol = rtol_for(stored);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const double e = std::isnan(g[i]) ? std::numeric_limits<double>::infinity() : std::fabs(g[i] - r[i]);
    const double ratio = e / (atol + rtol * (std::fabs(p[i]) + std::fabs(r[i])));
    if (ratio > worst) worst = ratio, at = i;
  }
  EXPECT_LE(worst, 1.0) << what << ": worst element [" << at << "] got " << g[at] << ", reference " << r[at]
                        << ", product without bias " << p[at];
}

class MatmulTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(MatmulTest);

// All four transpose combinations, alpha and beta away from 0 and 1, an
// output pre-filled with random values so beta's term is checked; odd sizes.
TEST_P(MatmulTest, AllTransposesWithAlphaBeta) {
  const DType S = GetParam();
  const int64_t M = 37, N = 29, K = 48;
  const double alpha = 0.75, beta = -0.625;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const std::string what = std::string("matmul ta=") + (ta ? "1" : "0") + " tb=" + (tb ? "1" : "0");
      HostTensor a = random_host(ta ? Shape{K, M} : Shape{M, K}, S, 1);
      HostTensor b = random_host(tb ? Shape{N, K} : Shape{K, N}, S, 2);
      HostTensor c = random_host({M, N}, S, 3);
      HostTensor ref = host_cast(c, DType::F64);
      matmul(cpu(), ref, host_cast(a, DType::F64), host_cast(b, DType::F64), ta, tb, alpha, beta);
      DeviceTensor a_dev = to_device(a), b_dev = to_device(b), c_dev = to_device(c);
      cuda::matmul(ctx(), c_dev, a_dev, b_dev, ta, tb, alpha, beta);
      expect_product(to_host(c_dev), ref, S, what);
    }
}

// With and without bias; out = 24 takes the aligned paths, out = 21 the odd ones.
TEST_P(MatmulTest, LinearForward) {
  const DType S = GetParam();
  const int64_t N = 37, in = 29;
  for (int64_t out : {int64_t(24), int64_t(21)})
    for (bool with_bias : {true, false}) {
      const std::string what = "linear_forward out=" + std::to_string(out) + (with_bias ? " bias" : " no bias");
      HostTensor x = random_host({N, in}, S, 4), w = random_host({out, in}, S, 5), b = random_host({out}, S, 6);
      HostTensor ref(Shape{N, out}, DType::F64);
      HostTensor b64 = host_cast(b, DType::F64);
      linear_forward(cpu(), ref, host_cast(x, DType::F64), host_cast(w, DType::F64),
                     with_bias ? b64.tensor() : Tensor());
      HostTensor product(Shape{N, out}, DType::F64);
      linear_forward(cpu(), product, host_cast(x, DType::F64), host_cast(w, DType::F64), Tensor());
      DeviceTensor x_dev = to_device(x), w_dev = to_device(w), b_dev = to_device(b), y({N, out}, S);
      cuda::linear_forward(ctx(), y, x_dev, w_dev, with_bias ? b_dev.tensor() : Tensor());
      if (with_bias) expect_biased_product(to_host(y), ref, product, S, what);
      else expect_product(to_host(y), ref, S, what);
    }
}

// dx overwritten and accumulated, dw and dbias accumulated in S and in f32.
// N = 301 rows spans three row chunks of the bias-gradient reduction.
TEST_P(MatmulTest, LinearBackward) {
  const DType S = GetParam();
  const int64_t N = 301, in = 29, out = 24;
  for (DType G : {S, DType::F32})
    for (GradMode mode : {GradMode::Overwrite, GradMode::Accumulate}) {
      const std::string what = std::string("linear_backward grad ") + dtype_name(G) +
                               (mode == GradMode::Overwrite ? " overwrite" : " accumulate");
      HostTensor x = random_host({N, in}, S, 7), w = random_host({out, in}, S, 8), dy = random_host({N, out}, S, 9);
      HostTensor dx = random_host({N, in}, S, 10), dw = random_host({out, in}, G, 11), db = random_host({out}, G, 12);
      HostTensor dx_ref = host_cast(dx, DType::F64), dw_ref = host_cast(dw, DType::F64),
                 db_ref = host_cast(db, DType::F64);
      linear_backward(cpu(), dx_ref, dw_ref, db_ref, host_cast(dy, DType::F64), host_cast(x, DType::F64),
                      host_cast(w, DType::F64), mode);
      DeviceTensor x_dev = to_device(x), w_dev = to_device(w), dy_dev = to_device(dy);
      DeviceTensor dx_dev = to_device(dx), dw_dev = to_device(dw), db_dev = to_device(db);
      cuda::linear_backward(ctx(), dx_dev, dw_dev, db_dev, dy_dev, x_dev, w_dev, mode);
      expect_product(to_host(dx_dev), dx_ref, S, what + " dx");
      expect_product(to_host(dw_dev), dw_ref, G, what + " dw");
      expect_product(to_host(db_dev), db_ref, G, what + " dbias");
    }
}

// Undefined dx and dbias are skipped; dw still accumulates.
TEST_P(MatmulTest, LinearBackwardWeightOnly) {
  const DType S = GetParam();
  const int64_t N = 45, in = 17, out = 13;
  HostTensor x = random_host({N, in}, S, 13), w = random_host({out, in}, S, 14), dy = random_host({N, out}, S, 15);
  HostTensor dw = random_host({out, in}, DType::F32, 16);
  HostTensor dx_ref(Shape{N, in}, DType::F64), dw_ref = host_cast(dw, DType::F64);
  linear_backward(cpu(), dx_ref, dw_ref, Tensor(), host_cast(dy, DType::F64), host_cast(x, DType::F64),
                  host_cast(w, DType::F64), GradMode::Overwrite);
  DeviceTensor x_dev = to_device(x), w_dev = to_device(w), dy_dev = to_device(dy), dw_dev = to_device(dw);
  cuda::linear_backward(ctx(), Tensor(), dw_dev, Tensor(), dy_dev, x_dev, w_dev, GradMode::Overwrite);
  expect_product(to_host(dw_dev), dw_ref, DType::F32, "linear_backward dw only");
}

// out = 24: the fused GELU epilogue for 16-bit storage (aux leading
// dimension divisible by 8; f32 storage always takes the unfused path, the
// epilogue's tanh may be an approximation below 16-bit rounding only);
// out = 21: the unfused fallback. The results must agree with the same bounds.
TEST_P(MatmulTest, LinearGeluForward) {
  const DType S = GetParam();
  const int64_t N = 37, in = 29;
  for (int64_t out : {int64_t(24), int64_t(21)})
    for (bool with_bias : {true, false}) {
      const std::string what = "linear_gelu_forward out=" + std::to_string(out) + (with_bias ? " bias" : " no bias");
      HostTensor x = random_host({N, in}, S, 17), w = random_host({out, in}, S, 18), b = random_host({out}, S, 19);
      HostTensor b64 = host_cast(b, DType::F64);
      HostTensor pre_ref(Shape{N, out}, DType::F64), y_ref(Shape{N, out}, DType::F64);
      linear_forward(cpu(), pre_ref, host_cast(x, DType::F64), host_cast(w, DType::F64),
                     with_bias ? b64.tensor() : Tensor());
      gelu_forward(cpu(), y_ref, pre_ref);
      HostTensor product(Shape{N, out}, DType::F64);
      linear_forward(cpu(), product, host_cast(x, DType::F64), host_cast(w, DType::F64), Tensor());
      DeviceTensor x_dev = to_device(x), w_dev = to_device(w), b_dev = to_device(b);
      DeviceTensor y({N, out}, S), pre({N, out}, S);
      cuda::linear_gelu_forward(ctx(), y, pre, x_dev, w_dev, with_bias ? b_dev.tensor() : Tensor());
      const double atol = kAccum * scale_of(pre_ref);
      if (with_bias) expect_biased_product(to_host(pre), pre_ref, product, S, what + " pre");
      else expect_close(to_host(pre), pre_ref, atol, rtol_for(S), what + " pre");
      // y: pre's error (with a bias, relative to |x w^T| + |pre|) through
      // |gelu'| <= 1.13, a possibly rounded pre, y's own rounding.
      const std::vector<double> p = values(pre_ref), yr = values(y_ref), yg = values(to_host(y)),
                                xw = values(product);
      double worst = 0;
      size_t at = 0;
      for (size_t i = 0; i < p.size(); ++i) {
        const double pre_err = atol + rtol_for(S) * (std::fabs(p[i]) + (with_bias ? std::fabs(xw[i]) : 0.0));
        const double tol = 1.13 * pre_err + rtol_for(S) * std::fabs(yr[i]) + 2e-6;
        const double e = std::isnan(yg[i]) ? std::numeric_limits<double>::infinity() : std::fabs(yg[i] - yr[i]) / tol;
        if (e > worst) worst = e, at = i;
      }
      EXPECT_LE(worst, 1.0) << what << " y: worst element [" << at << "] got " << yg[at] << ", reference " << yr[at];
    }
}

// dpre checked against gelu_backward in f64; dx, dw, dbias against the CPU
// linear_backward run on the stored dpre. dpre aliasing dy and not, dbias
// defined (fused gelu' + column sums) and not.
TEST_P(MatmulTest, LinearGeluBackward) {
  const DType S = GetParam();
  const int64_t N = 301, in = 29, out = 24;
  for (bool alias : {false, true})
    for (bool with_bias : {true, false}) {
      const std::string what =
          std::string("linear_gelu_backward") + (alias ? " aliased" : "") + (with_bias ? " bias" : " no bias");
      HostTensor x = random_host({N, in}, S, 20), w = random_host({out, in}, S, 21);
      HostTensor pre = random_host({N, out}, S, 22, 2.0), dy = random_host({N, out}, S, 23);
      HostTensor dx = random_host({N, in}, S, 24), dw = random_host({out, in}, DType::F32, 25),
                 db = random_host({out}, DType::F32, 26);
      DeviceTensor x_dev = to_device(x), w_dev = to_device(w), pre_dev = to_device(pre), dy_dev = to_device(dy);
      DeviceTensor dx_dev = to_device(dx), dw_dev = to_device(dw), db_dev = to_device(db);
      DeviceTensor dpre_own({N, out}, S);
      const Tensor dpre_dev = alias ? dy_dev.tensor() : dpre_own.tensor();
      cuda::linear_gelu_backward(ctx(), dx_dev, dw_dev, with_bias ? db_dev.tensor() : Tensor(), dpre_dev, dy_dev,
                                 pre_dev, x_dev, w_dev, GradMode::Accumulate);
      HostTensor dpre_ref(Shape{N, out}, DType::F64);
      gelu_backward(cpu(), dpre_ref, host_cast(dy, DType::F64), host_cast(pre, DType::F64));
      HostTensor dpre_got = to_host(dpre_dev);
      expect_close(dpre_got, dpre_ref, 1e-5, unit_roundoff(S) + 1e-6, what + " dpre");  // as gelu dx

      HostTensor dx_ref = host_cast(dx, DType::F64), dw_ref = host_cast(dw, DType::F64),
                 db_ref = host_cast(db, DType::F64);
      linear_backward(cpu(), dx_ref, dw_ref, with_bias ? db_ref.tensor() : Tensor(), host_cast(dpre_got, DType::F64),
                      host_cast(x, DType::F64), host_cast(w, DType::F64), GradMode::Accumulate);
      expect_product(to_host(dx_dev), dx_ref, S, what + " dx");
      expect_product(to_host(dw_dev), dw_ref, DType::F32, what + " dw");
      if (with_bias) expect_product(to_host(db_dev), db_ref, DType::F32, what + " dbias");
      else expect_equal(to_host(db_dev), db, what + " dbias untouched");
    }
}

}  // namespace
}  // namespace xirang::test
