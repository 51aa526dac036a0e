// CPU MoE permutation (kernels/moe.h): a counting sort of the (token, slot)
// assignments by expert, the row gather into expert order, and the
// gate-weighted combine back to token order, with their backwards.
//
// Every token-order output is written by one iteration that reads its k
// rows in slot order j = 0..k-1, so the results do not depend on the
// thread count or on how experts were ordered, and the combine matches a
// dense per-token loop bit for bit (kernels/moe.h says in which form).
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/moe.h"
#include "kernels/moe_checks.h"

namespace xirang {

using cpu::compute_t;
using cpu::dispatch_storage;
using cpu::load;
using cpu::store;

void moe_permutation(const KernelContext& ctx, Tensor sorted_slots, Tensor slot_rows, Tensor offsets, const Tensor& ids,
                     int64_t num_experts) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, moe_permutation(ctx, sorted_slots, slot_rows, offsets, ids, num_experts));
  const char* op = "moe_permutation";
  cpu::require_cpu(ctx, op);
  const int64_t n = moe_checks::check_permutation(op, sorted_slots, slot_rows, offsets, ids, num_experts);
  const int64_t E = num_experts;
  const int32_t* id = ids.data<int32_t>();
  int32_t* off = offsets.data<int32_t>();
  std::memset(off, 0, size_t(E + 1) * sizeof(int32_t));
  for (int64_t s = 0; s < n; ++s) {
    if (id[s] < 0 || id[s] >= E)
      fail(ErrorKind::Shape, op, ": slot ", s, " has expert ", id[s], ", expected 0 <= expert < ", E);
    ++off[id[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  // Slots visited in ascending order and placed at each expert's cursor:
  // the sort is stable, and serial (T*k indices: cheap beside the rows).
  std::vector<int32_t> cursor(off, off + E);
  int32_t* sorted = sorted_slots.data<int32_t>();
  int32_t* rows = slot_rows.data<int32_t>();
  for (int64_t s = 0; s < n; ++s) {
    const int32_t r = cursor[id[s]]++;
    sorted[r] = int32_t(s);
    rows[s] = r;
  }
}

void moe_permute(const KernelContext& ctx, Tensor xp, const Tensor& x, const Tensor& sorted_slots) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, moe_permute(ctx, xp, x, sorted_slots));
  const char* op = "moe_permute";
  cpu::require_cpu(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, x, xp, "sorted_slots", sorted_slots);
  const int32_t* sorted = sorted_slots.data<int32_t>();
  const size_t row_bytes = size_t(d.d) * dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(xp.raw());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d.T * d.k; ++r) std::memcpy(dst + r * row_bytes, src + (sorted[r] / d.k) * row_bytes, row_bytes);
}

void moe_permute_backward(const KernelContext& ctx, Tensor dx, const Tensor& dxp, const Tensor& slot_rows) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, moe_permute_backward(ctx, dx, dxp, slot_rows));
  const char* op = "moe_permute_backward";
  cpu::require_cpu(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, dx, dxp, "slot_rows", slot_rows);
  const int32_t* rows = slot_rows.data<int32_t>();
  dispatch_storage(dx.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using C = compute_t<S>;
    const S* g = dxp.data<S>();
    S* out = dx.data<S>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t c = 0; c < d.d; ++c) {
        C acc = 0;
        for (int64_t j = 0; j < d.k; ++j) acc += load(g[rows[t * d.k + j] * d.d + c]);
        out[t * d.d + c] = store<S>(acc);
      }
  });
}

void moe_unpermute_combine(const KernelContext& ctx, Tensor y, const Tensor& yp, const Tensor& gates,
                           const Tensor& slot_rows) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, moe_unpermute_combine(ctx, y, yp, gates, slot_rows));
  const char* op = "moe_unpermute_combine";
  cpu::require_cpu(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, y, yp, "slot_rows", slot_rows);
  check_shape(op, "gates", gates, {d.T, d.k});
  check_dtype(op, "gates", gates, moe_checks::gate_dtype(y.dtype()));
  const int32_t* rows = slot_rows.data<int32_t>();
  dispatch_storage(y.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using C = compute_t<S>;
    const S* in = yp.data<S>();
    const C* g = gates.data<C>();
    S* out = y.data<S>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t c = 0; c < d.d; ++c) {
        C acc = 0;
        // An explicit fused multiply-add: one rounding per step whatever the
        // compiler's contraction flags, and the same on CUDA (fmaf).
        for (int64_t j = 0; j < d.k; ++j) acc = std::fma(g[t * d.k + j], load(in[rows[t * d.k + j] * d.d + c]), acc);
        out[t * d.d + c] = store<S>(acc);
      }
  });
}

void moe_unpermute_combine_backward(const KernelContext& ctx, Tensor dyp, Tensor dgates, const Tensor& dy,
                                    const Tensor& yp, const Tensor& gates, const Tensor& slot_rows) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, moe_unpermute_combine_backward(ctx, dyp, dgates, dy, yp, gates, slot_rows));
  const char* op = "moe_unpermute_combine_backward";
  cpu::require_cpu(ctx, op);
  const moe_checks::RowDims d = moe_checks::check_rows(op, dy, yp, "slot_rows", slot_rows);
  check_same_shape(op, dyp, yp);
  check_dtype(op, "dyp", dyp, dy.dtype());
  const DType gd = moe_checks::gate_dtype(dy.dtype());
  check_shape(op, "gates", gates, {d.T, d.k});
  check_dtype(op, "gates", gates, gd);
  check_shape(op, "dgates", dgates, {d.T, d.k});
  check_dtype(op, "dgates", dgates, gd);
  const int32_t* rows = slot_rows.data<int32_t>();
  dispatch_storage(dy.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    using C = compute_t<S>;
    const S* pdy = dy.data<S>();
    const S* in = yp.data<S>();
    const C* g = gates.data<C>();
    S* out = dyp.data<S>();
    C* dg = dgates.data<C>();
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < d.T * d.k; ++s) {
      const int64_t t = s / d.k, r = rows[s];
      double dot = 0;
      for (int64_t c = 0; c < d.d; ++c) {
        const C v = load(pdy[t * d.d + c]);
        dot += double(load(in[r * d.d + c])) * double(v);
        out[r * d.d + c] = store<S>(C(g[s] * v));
      }
      dg[s] = C(dot);
    }
  });
}

}  // namespace xirang
