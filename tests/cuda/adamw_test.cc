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
//
// The grouped update (adamw_update_group) is held to the same tolerances
// against the CPU op per tensor, and to the same bits as the per-tensor
// CUDA op.
#include <string>
#include <vector>

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

// Copies host values into an existing device tensor (its pointer, and so the
// group's table, stays the same).
void overwrite(const DeviceTensor& dst, const HostTensor& src) {
  XR_CUDA_CHECK(cudaDeviceSynchronize());
  XR_CUDA_CHECK(cudaMemcpy(dst.tensor().raw(), src.tensor().raw(), src.tensor().bytes(), cudaMemcpyHostToDevice));
}

// The grouped update (one launch over all tensors) against the CPU op per
// tensor in f64, with the tolerances above: odd sizes (one of them over two
// chunks), weight decay on and off per tensor, the model copy in bf16, in
// f16, or none. Two steps through one table: the second reuses it (same
// tensors, new gradient values). The per-tensor CUDA op on the same inputs
// must give the same bits (one element update serves both).
TEST_P(AdamWTest, GroupMatchesReferencePerTensor) {
  const DType G = GetParam();
  const std::vector<int64_t> sizes{1, 7, 1000, 4099, 2 * kGroupChunk + 5};
  const std::vector<bool> decay{true, false, true, false, true};
  for (int copy_kind = 0; copy_kind < 3; ++copy_kind) {
    const bool has_copy = copy_kind < 2;
    const DType C = copy_kind == 0 ? DType::BF16 : DType::F16;
    SCOPED_TRACE(has_copy ? std::string("model copy ") + dtype_name(C) : std::string("no model copy"));
    std::vector<HostTensor> p_ref, m_ref, v_ref;
    std::vector<DeviceTensor> p, m, v, g, copy, p1, m1, v1, copy1;  // group; per-tensor op
    int64_t total = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const Shape shape{sizes[i]};
      const uint64_t seed = 100 * uint64_t(copy_kind) + 10 * i;
      HostTensor hp = random_host(shape, DType::F32, seed + 1), hm = random_host(shape, DType::F32, seed + 2, 0.1);
      HostTensor hv = second_moment(shape, seed + 3);
      p_ref.push_back(host_cast(hp, DType::F64));
      m_ref.push_back(host_cast(hm, DType::F64));
      v_ref.push_back(host_cast(hv, DType::F64));
      p.push_back(to_device(hp));
      m.push_back(to_device(hm));
      v.push_back(to_device(hv));
      p1.push_back(to_device(hp));
      m1.push_back(to_device(hm));
      v1.push_back(to_device(hv));
      g.emplace_back(shape, G);
      copy.emplace_back(shape, has_copy ? C : DType::F32);
      copy1.emplace_back(shape, has_copy ? C : DType::F32);
      total += sizes[i];
    }
    std::vector<AdamWTensor> group;
    for (size_t i = 0; i < sizes.size(); ++i)
      group.push_back({p[i], g[i], m[i], v[i], has_copy ? Tensor(copy[i]) : Tensor(), bool(decay[i])});
    DeviceTensor mem({group_table_words(int64_t(sizes.size()), total)}, DType::U32);
    GroupTable table(mem);
    for (int64_t t : {3, 4}) {
      const AdamWStep s{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = t,
                        .grad_scale = 0.8};
      for (size_t i = 0; i < sizes.size(); ++i) {
        HostTensor hg = random_host({sizes[i]}, G, 1000 + 100 * uint64_t(copy_kind) + 10 * i + uint64_t(t));
        overwrite(g[i], hg);
        AdamWStep si = s;
        si.weight_decay = decay[i] ? s.weight_decay : 0.0;
        adamw_update(cpu(), p_ref[i], host_cast(hg, DType::F64), m_ref[i], v_ref[i], si);
        cuda::adamw_update(ctx(), p1[i], g[i], m1[i], v1[i], si, has_copy ? Tensor(copy1[i]) : Tensor());
      }
      cuda::adamw_update_group(ctx(), group, s, table);
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::string at = " of tensor " + std::to_string(i) + " (" + std::to_string(sizes[i]) + ")";
      HostTensor got_p = to_host(p[i]);
      expect_close(got_p, p_ref[i], kAtol, kRtol, "param" + at);
      expect_close(to_host(m[i]), m_ref[i], kAtol, kRtol, "m" + at);
      expect_close(to_host(v[i]), v_ref[i], kAtol, kRtol, "v" + at);
      expect_equal(got_p, to_host(p1[i]), "param against the per-tensor op" + at);
      expect_equal(to_host(m[i]), to_host(m1[i]), "m against the per-tensor op" + at);
      expect_equal(to_host(v[i]), to_host(v1[i]), "v against the per-tensor op" + at);
      if (has_copy) expect_equal(to_host(copy[i]), host_cast(got_p, C), "model copy" + at);
    }
  }
}

}  // namespace
}  // namespace xirang::test
