// CUDA cross entropy (fused, and the three vocabulary-parallel phases)
// against the CPU fused op in f64 on the same rounded logits, for every
// storage dtype.
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|:
// - losses (f32 for every storage dtype): logz = max + log(sum) with a
//   float sum of V terms (relative ~1e-6, so ~1e-6 absolute after the log)
//   minus the target logit: atol 1e-5 on losses of size ~10, rtol 1e-6.
// - dlogits = (p - onehot) dloss: p = exp(x - logz) with x - logz formed in
//   float (absolute error ~1e-6 for |logz| ~ 10, so ~1e-6 relative on p);
//   stored once in S: rtol = u_S + 5e-6. atol = 1e-9 dloss only absorbs
//   exact zeros (the padding columns must come out as 0), plus, for f16,
//   half its smallest subnormal (2^-25): p dloss goes down to ~1e-11 here,
//   far below f16's normal range, where rounding is absolute.
// - Shards add one f32 rounding of each partial sum (6e-8 relative): same
//   bounds.
// A leak of the padding columns (logits ~1e4) or a wrong target column is
// off by ~dloss.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cross_entropy.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

constexpr double kLossAtol = 1e-5, kLossRtol = 1e-6;

// (N, Vp) logits: real columns N(0, 3); padding columns around +1e4, which
// would swamp the softmax if a kernel let them in.
HostTensor make_logits(int64_t N, int64_t V, int64_t Vp, DType S, uint64_t seed) {
  std::vector<double> l = values(random_host({N, Vp}, DType::F64, seed, 3.0));
  std::vector<double> pad = values(random_host({N, Vp}, DType::F64, seed + 1, 100.0, 1e4));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) l[n * Vp + j] = pad[n * Vp + j];
  return host_from(l, {N, Vp}, S);
}

// Random targets in [0, V) with the first and last real columns and both
// sides of the 128-column shard boundaries forced in.
HostTensor make_targets(int64_t N, int64_t V, uint64_t seed) {
  HostTensor t = random_tokens({N}, seed, 0, int32_t(V));
  auto* p = static_cast<int32_t*>(t.tensor().raw());
  const int32_t edges[] = {0, int32_t(V - 1), 127, 128, 255, 256};
  for (size_t k = 0; k < std::size(edges) && 2 * k + 1 < size_t(N); ++k)
    if (edges[k] < V) p[2 * k + 1] = edges[k];
  return t;
}

struct Reference {
  HostTensor losses, dlogits;  // (N), (N, Vp) in f64
};

Reference cpu_reference(const HostTensor& logits, const HostTensor& targets, int64_t V, double dloss) {
  const int64_t N = logits.shape()[0], Vp = logits.shape()[1];
  Reference r{HostTensor({N}, DType::F64), HostTensor({N, Vp}, DType::F64)};
  cross_entropy_forward_backward(KernelContext{}, r.losses, r.dlogits, host_cast(logits, DType::F64), targets, V,
                                 dloss);
  return r;
}

void expect_dlogits(const Tensor& got, const Tensor& ref, DType S, double dloss, const std::string& what) {
  const double atol = 1e-9 * dloss + (S == DType::F16 ? std::ldexp(1.0, -25) : 0.0);
  expect_close(got, ref, atol, unit_roundoff(S) + 5e-6, what);
}

struct CeShape {
  int64_t N, V, Vp;
};
// 37 rows of 300 real columns padded to 384; then 5 rows of 1200 columns
// and no padding (each of the 512 threads loops three times).
const CeShape kShapes[] = {{37, 300, 384}, {5, 1200, 1200}};

class CudaCrossEntropyTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaCrossEntropyTest);

// Separate dlogits, then in place (dlogits aliasing logits), then losses only.
TEST_P(CudaCrossEntropyTest, Fused) {
  const DType S = GetParam();
  for (const CeShape& c : kShapes) {
    const std::string shape = " N " + std::to_string(c.N) + " V " + std::to_string(c.V);
    const double dloss = 1.0 / double(c.N);
    HostTensor logits = make_logits(c.N, c.V, c.Vp, S, 500 + uint64_t(c.V));
    HostTensor targets = make_targets(c.N, c.V, 502);
    const Reference ref = cpu_reference(logits, targets, c.V, dloss);
    DeviceTensor l_dev = to_device(logits), t_dev = to_device(targets);

    DeviceTensor losses({c.N}, DType::F32), dlogits({c.N, c.Vp}, S);
    cuda::cross_entropy_forward_backward(ctx(), losses, dlogits, l_dev, t_dev, c.V, dloss);
    expect_close(to_host(losses), ref.losses, kLossAtol, kLossRtol, "losses" + shape);
    expect_dlogits(to_host(dlogits), ref.dlogits, S, dloss, "dlogits" + shape);

    DeviceTensor losses2({c.N}, DType::F32);
    cuda::cross_entropy_forward_backward(ctx(), losses2, l_dev, l_dev, t_dev, c.V, dloss);
    expect_close(to_host(losses2), ref.losses, kLossAtol, kLossRtol, "in-place losses" + shape);
    expect_dlogits(to_host(l_dev), ref.dlogits, S, dloss, "in-place dlogits" + shape);

    DeviceTensor l_dev2 = to_device(logits), losses3({c.N}, DType::F32);
    cuda::cross_entropy_forward_backward(ctx(), losses3, Tensor(), l_dev2, t_dev, c.V, dloss);
    expect_close(to_host(losses3), ref.losses, kLossAtol, kLossRtol, "losses without dlogits" + shape);
    expect_equal(to_host(l_dev2), logits, "logits untouched without dlogits" + shape);
  }
}

// GPT-2's padded vocabulary (50257 real columns of 50304) on 1024 rows, a
// microbatch of T = 1024. With ~100 terms per thread before the block's
// tree, the float sum of V exponentials carries a relative error of up to
// ~(V / 512 + 9) u_f32 ~ 6e-6 (the small shapes above: ~1e-6), so logz and
// every p = exp(x - logz) do too: losses atol 3e-5, dlogits rtol u_S + 2e-5.
TEST_P(CudaCrossEntropyTest, GptVocabulary) {
  const DType S = GetParam();
  const int64_t N = 1024, V = 50257, Vp = 50304;
  const double dloss = 1.0 / double(N);
  HostTensor logits = make_logits(N, V, Vp, S, 520);
  HostTensor targets = make_targets(N, V, 521);
  const Reference ref = cpu_reference(logits, targets, V, dloss);
  DeviceTensor l_dev = to_device(logits), t_dev = to_device(targets);
  DeviceTensor losses({N}, DType::F32), dlogits({N, Vp}, S);
  cuda::cross_entropy_forward_backward(ctx(), losses, dlogits, l_dev, t_dev, V, dloss);
  expect_close(to_host(losses), ref.losses, 3e-5, kLossRtol, "losses, GPT-2 vocabulary");
  const double atol = 1e-9 * dloss + (S == DType::F16 ? std::ldexp(1.0, -25) : 0.0);
  expect_close(to_host(dlogits), ref.dlogits, atol, unit_roundoff(S) + 2e-5, "dlogits, GPT-2 vocabulary");
}

// Targets cannot be checked on the host without a synchronization: one
// outside [0, V) gives a NaN loss for its row and leaves the others intact.
TEST_P(CudaCrossEntropyTest, TargetOutOfRangeGivesNaN) {
  const DType S = GetParam();
  const int64_t N = 6, V = 300, Vp = 384;
  HostTensor logits = make_logits(N, V, Vp, S, 510);
  HostTensor targets = make_targets(N, V, 511);
  const Reference ref = cpu_reference(logits, targets, V, 1.0);
  static_cast<int32_t*>(targets.tensor().raw())[2] = int32_t(V);  // a padding column
  static_cast<int32_t*>(targets.tensor().raw())[4] = -1;
  DeviceTensor l_dev = to_device(logits), t_dev = to_device(targets), losses({N}, DType::F32);
  cuda::cross_entropy_forward_backward(ctx(), losses, Tensor(), l_dev, t_dev, V, 1.0);
  const std::vector<double> got = values(to_host(losses)), want = values(ref.losses);
  for (int64_t i = 0; i < N; ++i) {
    if (i == 2 || i == 4)
      EXPECT_TRUE(std::isnan(got[i])) << "row " << i << " loss " << got[i];
    else
      EXPECT_NEAR(got[i], want[i], kLossAtol + kLossRtol * std::fabs(want[i])) << "row " << i;
  }
}

// The three phases over tp column shards, with the Max and Sum all-reduces
// done here on the host (in shard order, as the communicator would), must
// give the fused losses and, side by side, the fused dlogits. tp = 3 splits
// 384 columns at 128 and 256 (the last shard is partly padding); tp = 4
// splits 512, so the last shard is padding only.
TEST_P(CudaCrossEntropyTest, Shards) {
  const DType S = GetParam();
  const int64_t N = 29, V = 300;
  for (int64_t tp : {3, 4}) {
    const int64_t Vp = 128 * tp, Vs = 128;
    const double dloss = 1.0 / double(N);
    HostTensor logits = make_logits(N, V, Vp, S, 520 + uint64_t(tp));
    HostTensor targets = make_targets(N, V, 522);
    const Reference ref = cpu_reference(logits, targets, V, dloss);
    const std::vector<double> all = values(logits);
    DeviceTensor t_dev = to_device(targets);

    std::vector<DeviceTensor> shard(static_cast<size_t>(tp));
    for (int64_t r = 0; r < tp; ++r) {
      std::vector<double> cols(size_t(N * Vs));
      for (int64_t n = 0; n < N; ++n)
        std::copy_n(all.begin() + n * Vp + r * Vs, Vs, cols.begin() + n * Vs);
      shard[size_t(r)] = to_device(host_from(cols, {N, Vs}, S));
    }

    std::vector<double> row_max(size_t(N), -std::numeric_limits<double>::infinity());
    for (int64_t r = 0; r < tp; ++r) {
      DeviceTensor m({N}, DType::F32);
      cuda::cross_entropy_shard_max(ctx(), m, shard[size_t(r)], r * Vs, V);
      const std::vector<double> mv = values(to_host(m));
      for (int64_t n = 0; n < N; ++n) row_max[size_t(n)] = std::max(row_max[size_t(n)], mv[size_t(n)]);
    }
    DeviceTensor max_dev = to_device(host_from(row_max, {N}, DType::F32));

    std::vector<double> sums(size_t(2 * N), 0.0);
    for (int64_t r = 0; r < tp; ++r) {
      DeviceTensor s({N, 2}, DType::F32);
      cuda::cross_entropy_shard_sums(ctx(), s, shard[size_t(r)], t_dev, max_dev, r * Vs, V);
      const std::vector<double> sv = values(to_host(s));
      for (size_t k = 0; k < sums.size(); ++k) sums[k] += sv[k];
    }
    DeviceTensor sums_dev = to_device(host_from(sums, {N, 2}, DType::F32));

    const std::vector<double> ref_d = values(ref.dlogits);
    for (int64_t r = 0; r < tp; ++r) {
      const std::string what = " tp " + std::to_string(tp) + " shard " + std::to_string(r);
      DeviceTensor losses({N}, DType::F32);
      // In place, as the model runs it: dlogits aliasing the shard's logits.
      cuda::cross_entropy_shard_finish(ctx(), losses, shard[size_t(r)], shard[size_t(r)], t_dev, max_dev, sums_dev,
                                       r * Vs, V, dloss);
      expect_close(to_host(losses), ref.losses, kLossAtol, kLossRtol, "losses" + what);
      std::vector<double> want(size_t(N * Vs));
      for (int64_t n = 0; n < N; ++n)
        std::copy_n(ref_d.begin() + n * Vp + r * Vs, Vs, want.begin() + n * Vs);
      expect_dlogits(to_host(shard[size_t(r)]), host_from(want, {N, Vs}, DType::F64), S, dloss, "dlogits" + what);
    }
  }
}

}  // namespace
}  // namespace xirang::test
