// CUDA AdamW against the CPU op in f64: f32 master, m and v; the gradient in
// each storage dtype (the test parameter); the model copy absent, 16-bit, or
// the master itself.
//
// Tolerances: the GPU evaluates the same formula in float. m = b1 m + (1 -
// b1) g can cancel, leaving an absolute error of a few u_f32 times |m| + |g|
// (inputs are O(1), so below 1e-6); v has no cancellation; the parameter
// step lr * update (lr = 1e-2) carries a relative error of a few u_f32 in
// update. atol = 1e-6 with rtol = 1e-6 covers these with margin, while a
// wrong bias correction, decay or clipping factor moves the parameter by
// 1e-4 or more. The model copy has no freedom: it must be exactly the
// stored master rounded to its dtype.
#include "kernels/adamw.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

class AdamWTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(AdamWTest);

constexpr double kAtol = 1e-6, kRtol = 1e-6;

// v starts positive, as a second moment does.
HostTensor second_moment(Shape shape, uint64_t seed) {
  std::vector<double> v = values(random_host(shape, DType::F64, seed));
  for (auto& x : v) x = x * x;
  return host_from(v, shape, DType::F32);
}

// Two steps (bias corrections for t = 3 and t = 4) with decay and clipping.
TEST_P(AdamWTest, MatchesReferenceOverTwoSteps) {
  const DType G = GetParam();
  const Shape shape{1000003};
  HostTensor p = random_host(shape, DType::F32, 1), m = random_host(shape, DType::F32, 2, 0.1);
  HostTensor v = second_moment(shape, 3);
  HostTensor p_ref = host_cast(p, DType::F64), m_ref = host_cast(m, DType::F64), v_ref = host_cast(v, DType::F64);
  DeviceTensor p_dev = to_device(p), m_dev = to_device(m), v_dev = to_device(v);
  for (int64_t t : {3, 4}) {
    HostTensor g = random_host(shape, G, 10 + uint64_t(t));
    const AdamWStep s{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = t,
                      .grad_scale = 0.8};
    adamw_update(cpu(), p_ref, host_cast(g, DType::F64), m_ref, v_ref, s);
    cuda::adamw_update(ctx(), p_dev, to_device(g), m_dev, v_dev, s, Tensor());
  }
  expect_close(to_host(p_dev), p_ref, kAtol, kRtol, "adamw param");
  expect_close(to_host(m_dev), m_ref, kAtol, kRtol, "adamw m");
  expect_close(to_host(v_dev), v_ref, kAtol, kRtol, "adamw v");
}

// The copy in each dtype, and the master passed as its own copy.
TEST_P(AdamWTest, ModelCopyIsTheRoundedMaster) {
  const DType G = GetParam();
  const Shape shape{4099};
  const AdamWStep s{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 1,
                    .grad_scale = 1.0};
  HostTensor g = random_host(shape, G, 20);
  for (DType C : {DType::F32, DType::BF16, DType::F16}) {
    DeviceTensor p_dev = to_device(random_host(shape, DType::F32, 21)), m_dev = to_device(random_host(shape, DType::F32, 22));
    DeviceTensor v_dev = to_device(second_moment(shape, 23)), copy(shape, C);
    cuda::adamw_update(ctx(), p_dev, to_device(g), m_dev, v_dev, s, copy);
    HostTensor master = to_host(p_dev);
    expect_equal(to_host(copy), host_cast(master, C), std::string("model copy ") + dtype_name(C));
  }
  DeviceTensor p_dev = to_device(random_host(shape, DType::F32, 21)), m_dev = to_device(random_host(shape, DType::F32, 22));
  DeviceTensor v_dev = to_device(second_moment(shape, 23));
  HostTensor p_ref = host_cast(to_host(p_dev), DType::F64), m_ref = host_cast(to_host(m_dev), DType::F64),
             v_ref = host_cast(to_host(v_dev), DType::F64);
  adamw_update(cpu(), p_ref, host_cast(g, DType::F64), m_ref, v_ref, s);
  cuda::adamw_update(ctx(), p_dev, to_device(g), m_dev, v_dev, s, p_dev);
  expect_close(to_host(p_dev), p_ref, kAtol, kRtol, "master as its own copy");
}

}  // namespace
}  // namespace xirang::test
