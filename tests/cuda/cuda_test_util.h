// tests/cuda/cuda_test_util.h: helpers for the CUDA differential tests, which
// run an op on the GPU and compare it with the CPU public op (the reference)
// computed in f64 on the same, already rounded, inputs.
//
//   class GeluTest : public xirang::test::CudaTest {};
//   TEST_F(GeluTest, Forward) {                      // skips without a GPU
//     HostTensor x = random_host({37, 29}, DType::BF16, /*seed=*/1);
//     DeviceTensor dx = to_device(x), dy(x.shape(), DType::BF16);
//     cuda::gelu_forward(ctx(), dy, dx);
//     HostTensor ref(x.shape(), DType::F64);
//     gelu_forward(cpu(), ref, host_cast(x, DType::F64));
//     expect_close(to_host(dy), ref, 1e-6, unit_roundoff(DType::BF16), "gelu y");
//   }
//
// In a plain TEST (no fixture) start with XR_REQUIRE_GPU(); without a
// visible device the test is reported as skipped with the reason.
//
// Copies are synchronous and wait for the whole device, so a test never
// reads a result its stream has not finished: simple, and slow only where
// it does not matter.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/tensor.h"
#include "kernels/context.h"
#include "kernels/cuda/context.h"

namespace xirang::test {

// One attention problem: qkv (B, T, (H + 2 KV) D), q, k and v drawn at
// `scale` (the flash attention tests, fp32 and tensor-core paths).
struct AttentionCase {
  int64_t B, T, H, KV, D;
  double scale;  // of the random q, k, v
  int64_t C() const { return H * D; }
  int64_t W() const { return (H + 2 * KV) * D; }
  std::string str() const {
    return "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) + " KV " +
           std::to_string(KV) + " D " + std::to_string(D) + " scale " + std::to_string(scale);
  }
};

// ---------------------------------------------------------------- GPU presence
// Empty when a device is visible, else why not.
inline std::string gpu_missing_reason() {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return std::string("no CUDA device visible (cudaGetDeviceCount: ") + cudaGetErrorString(rc) + ")";
  }
  if (n == 0) return "no CUDA device visible (cudaGetDeviceCount reports 0 devices)";
  return "";
}

// Marks the current test skipped when there is no GPU. GTEST_SKIP() returns
// from this function only: call it from SetUp() (gtest then skips the body)
// or use XR_REQUIRE_GPU() in a test body.
inline void require_gpu() {
  static const std::string reason = gpu_missing_reason();
  if (!reason.empty()) GTEST_SKIP() << reason;
}

#define XR_REQUIRE_GPU()                                            \
  do {                                                              \
    ::xirang::test::require_gpu();                                  \
    if (::testing::Test::IsSkipped()) return;                       \
  } while (0)

// ---------------------------------------------------------------- host tensors
// Host memory that owns its bytes, viewed as a Tensor (Device::CPU).
// Move-only: moving keeps the buffer, so the view stays valid.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(Shape shape, DType dtype)
      : buf_((size_t(shape.numel()) * dtype_size(dtype) + 7) / 8), t_(buf_.data(), shape, dtype, Device::CPU) {}
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;

  const Tensor& tensor() const { return t_; }
  operator Tensor() const { return t_; }
  const Shape& shape() const { return t_.shape(); }
  DType dtype() const { return t_.dtype(); }
  int64_t numel() const { return t_.numel(); }

 private:
  std::vector<uint64_t> buf_;  // 8-byte aligned for every dtype
  Tensor t_;
};

// Every element widened to double (f32, f64, bf16, f16, i32).
inline std::vector<double> values(const Tensor& t) {
  XR_CHECK(t.device() == Device::CPU, "values() reads host tensors, got ", t.str());
  std::vector<double> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) switch (t.dtype()) {
      case DType::F32: v[i] = static_cast<const float*>(t.raw())[i]; break;
      case DType::F64: v[i] = static_cast<const double*>(t.raw())[i]; break;
      case DType::BF16: v[i] = bf16_to_float(static_cast<const bf16*>(t.raw())[i]); break;
      case DType::F16: v[i] = f16_to_float(static_cast<const f16*>(t.raw())[i]); break;
      case DType::I32: v[i] = static_cast<const int32_t*>(t.raw())[i]; break;
      default: XR_CHECK(false, "values(): unsupported dtype ", dtype_name(t.dtype()));
    }
  return v;
}

// A host tensor holding `v` rounded to `dtype` (nearest even).
inline HostTensor host_from(const std::vector<double>& v, Shape shape, DType dtype) {
  XR_CHECK(int64_t(v.size()) == shape.numel(), v.size(), " values for shape ", shape.str());
  HostTensor h(shape, dtype);
  void* p = h.tensor().raw();
  for (size_t i = 0; i < v.size(); ++i) switch (dtype) {
      case DType::F32: static_cast<float*>(p)[i] = float(v[i]); break;
      case DType::F64: static_cast<double*>(p)[i] = v[i]; break;
      case DType::BF16: static_cast<bf16*>(p)[i] = float_to_bf16(float(v[i])); break;
      case DType::F16: static_cast<f16*>(p)[i] = float_to_f16(float(v[i])); break;
      case DType::I32: static_cast<int32_t*>(p)[i] = int32_t(v[i]); break;
      default: XR_CHECK(false, "host_from(): unsupported dtype ", dtype_name(dtype));
    }
  return h;
}

// `t` converted to `dtype`; to F64 this is exact for every float dtype.
inline HostTensor host_cast(const Tensor& t, DType dtype) { return host_from(values(t), t.shape(), dtype); }

// Normal(shift, scale) values rounded to `dtype`. A continuous distribution
// never yields exact zeros in practice, so an output the kernel forgot to
// write cannot pass by accident. std::mt19937_64, independent of the code
// under test.
inline HostTensor random_host(Shape shape, DType dtype, uint64_t seed, double scale = 1.0, double shift = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> v(size_t(shape.numel()));
  for (auto& x : v) x = shift + scale * dist(gen);
  return host_from(v, shape, dtype);
}

// Token ids uniform in [lo, hi), as an I32 host tensor.
inline HostTensor random_tokens(Shape shape, uint64_t seed, int32_t lo, int32_t hi) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi - 1);
  HostTensor h(shape, DType::I32);
  auto* p = static_cast<int32_t*>(h.tensor().raw());
  for (int64_t i = 0; i < shape.numel(); ++i) p[i] = dist(gen);
  return h;
}

// Largest relative rounding error of one store in `dtype` (round to nearest):
// 2^-p for p significand bits.
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::F32: return std::ldexp(1.0, -24);
    case DType::BF16: return std::ldexp(1.0, -8);
    case DType::F16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -53);
  }
}

// ---------------------------------------------------------------- device tensors
// Device memory that owns its bytes, viewed as a Tensor (Device::CUDA).
// A new DeviceTensor is filled with 0xff bytes, a NaN in f32, bf16 and f16,
// so an output element the kernel never writes fails every comparison.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(Shape shape, DType dtype) {
    void* p = nullptr;
    const size_t bytes = size_t(shape.numel()) * dtype_size(dtype);
    XR_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
    mem_.reset(p);
    XR_CUDA_CHECK(cudaMemset(p, 0xff, bytes));
    // Not ordered with the context's non-blocking stream: wait for the fill.
    XR_CUDA_CHECK(cudaDeviceSynchronize());
    t_ = Tensor(p, shape, dtype, Device::CUDA);
  }
  const Tensor& tensor() const { return t_; }
  operator Tensor() const { return t_; }
  const Shape& shape() const { return t_.shape(); }
  DType dtype() const { return t_.dtype(); }

 private:
  // Work queued on a non-blocking stream may still read a temporary
  // DeviceTensor passed to an op: drain the device before freeing.
  struct Free {
    void operator()(void* p) const {
      cudaDeviceSynchronize();
      cudaFree(p);
    }
  };
  std::unique_ptr<void, Free> mem_;
  Tensor t_;
};

// Waits for all queued device work, then copies.
inline DeviceTensor to_device(const Tensor& host) {
  XR_CHECK(host.device() == Device::CPU, "to_device() copies a host tensor, got ", host.str());
  DeviceTensor d(host.shape(), host.dtype());
  XR_CUDA_CHECK(cudaDeviceSynchronize());
  XR_CUDA_CHECK(cudaMemcpy(d.tensor().raw(), host.raw(), host.bytes(), cudaMemcpyHostToDevice));
  XR_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

inline HostTensor to_host(const Tensor& device) {
  XR_CHECK(device.device() == Device::CUDA, "to_host() copies a device tensor, got ", device.str());
  HostTensor h(device.shape(), device.dtype());
  XR_CUDA_CHECK(cudaDeviceSynchronize());
  XR_CUDA_CHECK(cudaMemcpy(h.tensor().raw(), device.raw(), device.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// ---------------------------------------------------------------- comparisons
// Per element |got - ref| <= atol + rtol |ref|, any float dtypes; NaN in
// `got` fails. Reports the worst element (largest error over its tolerance).
inline void expect_close(const Tensor& got, const Tensor& ref, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(got.numel(), ref.numel()) << what;
  const std::vector<double> g = values(got), r = values(ref);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    double e = std::fabs(g[i] - r[i]);
    if (std::isnan(e)) e = std::numeric_limits<double>::infinity();
    const double ratio = e / (atol + rtol * std::fabs(r[i]));
    if (ratio > worst) worst = ratio, at = i;
  }
  EXPECT_LE(worst, 1.0) << what << ": worst element [" << at << "] got " << g[at] << ", reference " << r[at]
                        << " (tolerance " << atol << " + " << rtol << " |ref|)";
}

// Bitwise-equal values (NaN equals NaN): for results with no rounding freedom.
inline void expect_equal(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.numel(), ref.numel()) << what;
  const std::vector<double> g = values(got), r = values(ref);
  for (size_t i = 0; i < r.size(); ++i)
    if (!(g[i] == r[i] || (std::isnan(g[i]) && std::isnan(r[i])))) {
      ADD_FAILURE() << what << ": element [" << i << "] got " << g[i] << ", expected " << r[i];
      return;
    }
}

// max |v| over a tensor (at least 1): the scale of absolute tolerances.
inline double scale_of(const Tensor& t) {
  double s = 1.0;
  for (double x : values(t)) s = std::max(s, std::fabs(x));
  return s;
}

// ---------------------------------------------------------------- fixtures
// Skips without a GPU; otherwise owns a CudaContext on device 0.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    require_gpu();
    if (IsSkipped()) return;
    cuda_ = std::make_unique<CudaContext>(0);
  }
  void TearDown() override { cuda_.reset(); }

  KernelContext ctx() const { return cuda_->kernel_context(); }
  static KernelContext cpu() { return KernelContext{}; }
  void sync() const { cuda_->synchronize(); }

 private:
  std::unique_ptr<CudaContext> cuda_;
};

// CudaTest run once per storage dtype:
//   class AddTest : public CudaDTypeTest {};
//   TEST_P(AddTest, Basic) { DType s = GetParam(); ... }
//   XR_INSTANTIATE_STORAGE_DTYPES(AddTest);
class CudaDTypeTest : public CudaTest, public ::testing::WithParamInterface<DType> {};

inline std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) { return dtype_name(info.param); }

#define XR_INSTANTIATE_STORAGE_DTYPES(suite)                                                             \
  INSTANTIATE_TEST_SUITE_P(Storage, suite, ::testing::Values(DType::F32, DType::BF16, DType::F16), \
                           ::xirang::test::dtype_param_name)

}  // namespace xirang::test
