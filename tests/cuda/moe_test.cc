// CUDA MoE kernels (kernels/moe.h) against the CPU ops on the same inputs:
// the router (ids and counts equal, gates and the backward close), the
// permutation equal, permute/combine and their backwards bitwise (the same
// float operations in the same order: a copy, fmaf in slot order, one
// product, float sums over k), and the grouped product against the CPU in
// f64 (per expert; ragged with empty experts).
//
// Tolerances, per element |got - ref| <= atol + rtol |ref|: router gates
// and scores 1e-6 (expf vs std::exp: ~2 ulp of values <= 1); router
// backward 1e-6 * scale; grouped product as tests/cuda/matmul_test.cc
// justifies: atol 2e-5 * scale, rtol u_S for a 16-bit result; dW beside
// 16-bit rows is F32: rtol 0. dgates: double sums in the same order, 1e-12.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/moe.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

constexpr int64_t T = 67, E = 16, K = 4, D = 96;

class CudaMoeTest : public CudaTest {};

TEST_F(CudaMoeTest, Router) {
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid})
    for (bool normalize : {true, false}) {
      const RouterOptions o{score, K, normalize};
      const std::string what = std::string(score == RouterScore::Softmax ? "softmax" : "sigmoid") +
                               (normalize ? " normalised" : "");
      HostTensor logits = random_host({T, E}, DType::F32, 800, 1.5), bias = random_host({E}, DType::F32, 801, 0.3);
      HostTensor dgates = random_host({T, K}, DType::F32, 802);
      HostTensor ids({T, K}, DType::I32), gates({T, K}, DType::F32), scores({T, E}, DType::F32), counts({E}, DType::I32);
      HostTensor dlogits({T, E}, DType::F32);
      router_forward(cpu(), ids, gates, scores, counts, logits, bias, o);
      router_backward(cpu(), dlogits, dgates, ids, scores, o);
      DeviceTensor l = to_device(logits), b = to_device(bias), dg = to_device(dgates);
      DeviceTensor ids_d({T, K}, DType::I32), gates_d({T, K}, DType::F32), scores_d({T, E}, DType::F32),
          counts_d({E}, DType::I32), dl_d({T, E}, DType::F32);
      cuda::router_forward(ctx(), ids_d, gates_d, scores_d, counts_d, l, b, o);
      expect_equal(to_host(ids_d), ids, what + " ids");
      expect_equal(to_host(counts_d), counts, what + " counts");
      expect_close(to_host(gates_d), gates, 1e-6, 1e-6, what + " gates");
      expect_close(to_host(scores_d), scores, 1e-6, 1e-6, what + " scores");
      // The backward from the CPU's own ids and scores, so only it differs.
      DeviceTensor ids_c = to_device(ids), scores_c = to_device(scores);
      cuda::router_backward(ctx(), dl_d, dg, ids_c, scores_c, o);
      expect_close(to_host(dl_d), dlogits, 1e-6 * scale_of(dlogits), 1e-6, what + " dlogits");
    }
}

class CudaMoePermuteTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaMoePermuteTest);

TEST_P(CudaMoePermuteTest, PermuteCombineAndBackwardsBitwise) {
  const DType S = GetParam();
  // Ids over 13 of 16 experts (13..15 empty), repeats allowed.
  HostTensor ids = random_tokens({T, K}, 810, 0, 13);
  HostTensor sorted({T * K}, DType::I32), rows({T * K}, DType::I32), offsets({E + 1}, DType::I32);
  moe_permutation(cpu(), sorted, rows, offsets, ids, E);
  DeviceTensor ids_d = to_device(ids), sorted_d({T * K}, DType::I32), rows_d({T * K}, DType::I32),
      offsets_d({E + 1}, DType::I32);
  cuda::moe_permutation(ctx(), sorted_d, rows_d, offsets_d, ids_d, E);
  expect_equal(to_host(sorted_d), sorted, "sorted_slots");
  expect_equal(to_host(rows_d), rows, "slot_rows");
  expect_equal(to_host(offsets_d), offsets, "offsets");

  HostTensor x = random_host({T, D}, S, 811), yp = random_host({T * K, D}, S, 812), dy = random_host({T, D}, S, 813);
  HostTensor gates = random_host({T, K}, DType::F32, 814, 0.3, 0.5);
  HostTensor xp({T * K, D}, S), y({T, D}, S), dyp({T * K, D}, S), dg({T, K}, DType::F32), dx({T, D}, S);
  moe_permute(cpu(), xp, x, sorted);
  moe_unpermute_combine(cpu(), y, yp, gates, rows);
  moe_unpermute_combine_backward(cpu(), dyp, dg, dy, yp, gates, rows);
  moe_permute_backward(cpu(), dx, yp, rows);
  DeviceTensor x_d = to_device(x), yp_d = to_device(yp), dy_d = to_device(dy), g_d = to_device(gates);
  DeviceTensor xp_d({T * K, D}, S), y_d({T, D}, S), dyp_d({T * K, D}, S), dg_d({T, K}, DType::F32), dx_d({T, D}, S);
  cuda::moe_permute(ctx(), xp_d, x_d, sorted_d);
  cuda::moe_unpermute_combine(ctx(), y_d, yp_d, g_d, rows_d);
  cuda::moe_unpermute_combine_backward(ctx(), dyp_d, dg_d, dy_d, yp_d, g_d, rows_d);
  cuda::moe_permute_backward(ctx(), dx_d, yp_d, rows_d);
  expect_equal(to_host(xp_d), xp, "xp");
  expect_equal(to_host(y_d), y, "combine y");
  expect_equal(to_host(dyp_d), dyp, "dyp");
  expect_close(to_host(dg_d), dg, 1e-12, 1e-12, "dgates");
  expect_equal(to_host(dx_d), dx, "permute dx");
}

class CudaGroupedMatmulTest : public CudaDTypeTest {};
XR_INSTANTIATE_STORAGE_DTYPES(CudaGroupedMatmulTest);

TEST_P(CudaGroupedMatmulTest, ForwardAndBackward) {
  const DType S = GetParam();
  const DType G = S == DType::F32 ? S : DType::F32;  // dW accumulates in F32 beside 16-bit rows
  const int64_t IN = 64, OUT = 96;
  std::vector<int32_t> counts = {0, 37, 5, 0, 128, 1, 64, 0};  // empty first, middle, last
  const int64_t NE = int64_t(counts.size());
  HostTensor off({NE + 1}, DType::I32);
  auto* o = static_cast<int32_t*>(off.tensor().raw());
  o[0] = 0;
  for (int64_t e = 0; e < NE; ++e) o[e + 1] = o[e] + counts[e];
  const int64_t R = o[NE];
  HostTensor x = random_host({R, IN}, S, 820), w = random_host({NE, IN, OUT}, S, 821), dy = random_host({R, OUT}, S, 822);
  HostTensor dw0 = random_host({NE, IN, OUT}, G, 823);
  HostTensor y_ref({R, OUT}, DType::F64), dx_ref({R, IN}, DType::F64);
  HostTensor dw_ref = host_cast(dw0, DType::F64);
  HostTensor x64 = host_cast(x, DType::F64), w64 = host_cast(w, DType::F64), dy64 = host_cast(dy, DType::F64);
  grouped_matmul_forward(cpu(), y_ref, x64, w64, off);
  grouped_matmul_backward(cpu(), dx_ref, dw_ref, dy64, x64, w64, off, GradMode::Overwrite);
  DeviceTensor x_d = to_device(x), w_d = to_device(w), dy_d = to_device(dy), dw_d = to_device(dw0);
  DeviceTensor y_d({R, OUT}, S), dx_d({R, IN}, S);
  cuda::grouped_matmul_forward(ctx(), y_d, x_d, w_d, off);
  cuda::grouped_matmul_backward(ctx(), dx_d, dw_d, dy_d, x_d, w_d, off, GradMode::Overwrite);
  const double rtol = S == DType::F32 ? 0.0 : unit_roundoff(S);
  expect_close(to_host(y_d), y_ref, 2e-5 * scale_of(y_ref), rtol, "y");
  expect_close(to_host(dx_d), dx_ref, 2e-5 * scale_of(dx_ref), rtol, "dx");
  expect_close(to_host(dw_d), dw_ref, 2e-5 * scale_of(dw_ref), 0.0, "dw");
}

}  // namespace
}  // namespace xirang::test
