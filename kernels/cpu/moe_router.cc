// CPU MoE router (kernels/moe.h): scores, biased top-k selection, gates,
// counts, and the backward through the gates. One token per iteration; the
// counts are summed afterwards in token order, so every output is
// deterministic whatever the thread count.
#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/moe.h"
#include "kernels/moe_checks.h"

namespace xirang {

namespace {

template <class T>
void route_rows(const T* logits, const T* bias, int32_t* ids, T* gates, T* scores, const moe_checks::RouterDims& d,
                const RouterOptions& opt) {
  const int64_t E = d.E, k = d.k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t) {
    const T* l = logits + t * E;
    T* s = scores + t * E;
    if (opt.score == RouterScore::Softmax) {
      T m = l[0];
      for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += double(s[e] = std::exp(l[e] - m));
      const T inv = T(1.0 / sum);
      for (int64_t e = 0; e < E; ++e) s[e] *= inv;
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = T(1) / (T(1) + std::exp(-l[e]));
    }
    // Top-k by biased score: k passes of a strict-greater scan in ascending
    // expert order, so a tie goes to the lower index. E*k compares: E is at
    // most a few hundred and k at most ~8.
    int32_t* id = ids + t * k;
    double sel = 0;
    for (int64_t j = 0; j < k; ++j) {
      if (opt.force_balance) {  // k <= E: the k choices are distinct
        id[j] = int32_t((t * k + j) % E);
        sel += double(s[id[j]]);
        continue;
      }
      int64_t best = -1;
      T best_v = 0;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= id[i] == e;
        if (taken) continue;
        const T v = bias ? T(s[e] + bias[e]) : s[e];
        if (best < 0 || v > best_v) best = e, best_v = v;
      }
      id[j] = int32_t(best);
      sel += double(s[best]);  // the raw score: the bias only chooses
    }
    const T inv = opt.normalize ? T(1.0 / sel) : T(1);
    for (int64_t j = 0; j < k; ++j) gates[t * k + j] = s[id[j]] * inv;
  }
}

// ds (selected experts only) from dgates, then through the score function.
template <class T>
void route_backward_rows(T* dlogits, const T* dgates, const int32_t* ids, const T* scores,
                         const moe_checks::RouterDims& d, const RouterOptions& opt) {
  const int64_t E = d.E, k = d.k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t) {
    const T* s = scores + t * E;
    const T* dg = dgates + t * k;
    const int32_t* id = ids + t * k;
    T* dl = dlogits + t * E;
    for (int64_t e = 0; e < E; ++e) dl[e] = 0;  // ds, in place
    if (opt.normalize) {
      // g_j = s_j / S: ds_j = (dg_j - sum_l dg_l g_l) / S.
      double S = 0, dot = 0;
      for (int64_t j = 0; j < k; ++j) S += double(s[id[j]]);
      for (int64_t j = 0; j < k; ++j) dot += double(dg[j]) * double(s[id[j]]) / S;
      for (int64_t j = 0; j < k; ++j) dl[id[j]] = T((double(dg[j]) - dot) / S);
    } else {
      for (int64_t j = 0; j < k; ++j) dl[id[j]] = dg[j];
    }
    if (opt.score == RouterScore::Softmax) {
      double dot = 0;  // sum_f s_f ds_f over the selected f (ds is zero elsewhere)
      for (int64_t j = 0; j < k; ++j) dot += double(s[id[j]]) * double(dl[id[j]]);
      for (int64_t e = 0; e < E; ++e) dl[e] = T(double(s[e]) * (double(dl[e]) - dot));
    } else {
      for (int64_t e = 0; e < E; ++e) dl[e] = dl[e] * s[e] * (T(1) - s[e]);
    }
  }
}

}  // namespace

void router_forward(const KernelContext& ctx, Tensor ids, Tensor gates, Tensor scores, Tensor counts,
                    const Tensor& logits, const Tensor& bias, const RouterOptions& opt) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, router_forward(ctx, ids, gates, scores, counts, logits, bias, opt));
  const char* op = "router_forward";
  cpu::require_cpu(ctx, op);
  const moe_checks::RouterDims d = moe_checks::check_router(op, logits, ids, gates, scores, opt);
  if (bias.defined()) {
    check_shape(op, "bias", bias, {d.E});
    check_dtype(op, "bias", bias, logits.dtype());
  }
  if (counts.defined()) {
    check_shape(op, "counts", counts, {d.E});
    check_dtype(op, "counts", counts, DType::I32);
  }
  cpu::dispatch_float(logits.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    route_rows<T>(logits.data<T>(), bias.defined() ? bias.data<T>() : nullptr, ids.data<int32_t>(), gates.data<T>(),
                  scores.data<T>(), d, opt);
  });
  if (counts.defined()) {
    int32_t* c = counts.data<int32_t>();
    for (int64_t e = 0; e < d.E; ++e) c[e] = 0;
    const int32_t* id = ids.data<int32_t>();
    for (int64_t i = 0; i < d.T * d.k; ++i) ++c[id[i]];
  }
}

void router_backward(const KernelContext& ctx, Tensor dlogits, const Tensor& dgates, const Tensor& ids,
                     const Tensor& scores, const RouterOptions& opt) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  XR_ON_CUDA(ctx, router_backward(ctx, dlogits, dgates, ids, scores, opt));
  const char* op = "router_backward";
  cpu::require_cpu(ctx, op);
  const moe_checks::RouterDims d = moe_checks::check_router(op, dlogits, ids, dgates, scores, opt);
  cpu::dispatch_float(dlogits.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    route_backward_rows<T>(dlogits.data<T>(), dgates.data<T>(), ids.data<int32_t>(), scores.data<T>(), d, opt);
  });
}

}  // namespace xirang
