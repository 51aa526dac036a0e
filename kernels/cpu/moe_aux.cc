// CPU balance loss of the MoE router (kernels/moe.h router_aux_loss): the
// per-group selection fractions f and mean probabilities P, the loss, and
// its gradient through the score function. Sums run in double in row
// order, so the result does not depend on the thread count.
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/moe.h"
#include "kernels/moe_checks.h"

namespace xirang {

namespace {

// p_t (E) = the probabilities of row t: softmax scores as they are,
// sigmoid scores over their sum.
template <class T>
double prob_scale(const T* s, int64_t E, RouterScore score) {
  if (score == RouterScore::Softmax) return 1.0;
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += double(s[e]);
  return 1.0 / sum;
}

template <class T>
double aux_rows(T* dlogits, const int32_t* ids, const T* scores, int64_t T_rows, int64_t E, int64_t k, int64_t G,
                double coeff, double dloss_scale, RouterScore score) {
  const int64_t rows = T_rows / G;
  double loss = 0;
  const size_t n = static_cast<size_t>(E);
  std::vector<double> f(n), P(n), c(n);
  for (int64_t g = 0; g < G; ++g) {
    std::fill(f.begin(), f.end(), 0.0);
    std::fill(P.begin(), P.end(), 0.0);
    for (int64_t t = g * rows; t < (g + 1) * rows; ++t) {
      for (int64_t j = 0; j < k; ++j) f[size_t(ids[t * k + j])] += 1.0;
      const T* s = scores + t * E;
      const double inv = prob_scale(s, E, score);
      for (int64_t e = 0; e < E; ++e) P[size_t(e)] += double(s[e]) * inv;
    }
    // loss_g = coeff E / G sum_e f_e P_e; d loss_g / d p_te = c_e = coeff E f_e / (G rows).
    for (int64_t e = 0; e < E; ++e) {
      f[size_t(e)] /= double(rows * k);
      P[size_t(e)] /= double(rows);
      loss += coeff * double(E) / double(G) * f[size_t(e)] * P[size_t(e)];
      c[size_t(e)] = dloss_scale * coeff * double(E) * f[size_t(e)] / double(G * rows);
    }
    if (!dlogits) continue;
#pragma omp parallel for schedule(static)
    for (int64_t t = g * rows; t < (g + 1) * rows; ++t) {
      const T* s = scores + t * E;
      T* dl = dlogits + t * E;
      const double inv = prob_scale(s, E, score);
      double dot = 0;  // sum_e c_e p_te
      for (int64_t e = 0; e < E; ++e) dot += c[size_t(e)] * double(s[e]) * inv;
      for (int64_t e = 0; e < E; ++e) {
        const double se = double(s[e]);
        // softmax: dz_e = p_e (c_e - dot); sigmoid: p = s / S, ds_e = (c_e - dot) / S, dz_e = ds_e s_e (1 - s_e).
        const double dz = score == RouterScore::Softmax ? se * (c[size_t(e)] - dot)
                                                        : (c[size_t(e)] - dot) * inv * se * (1.0 - se);
        dl[e] = T(double(dl[e]) + dz);
      }
    }
  }
  return loss;
}

}  // namespace

double router_aux_loss(const KernelContext& ctx, Tensor dlogits, const Tensor& ids, const Tensor& scores,
                       int64_t groups, double coeff, double dloss_scale, const RouterOptions& opt) {
  OpScope scope(ctx.timeline, ctx.cuda_stream, OpKind::Elementwise);
  const char* op = "router_aux_loss";
  if (ctx.device == Device::CUDA)
    fail(ErrorKind::Usage, op, ": the balance loss has no CUDA version yet (model.moe.aux_loss=none on CUDA)");
  cpu::require_cpu(ctx, op);
  moe_checks::check_2d(op, "scores", scores);
  const int64_t T = scores.size(0), E = scores.size(1), k = opt.top_k;
  if (scores.dtype() != DType::F32 && scores.dtype() != DType::F64)
    fail(ErrorKind::Shape, op, ": scores have dtype ", dtype_name(scores.dtype()), " (routing runs in f32 or f64)");
  check_shape(op, "ids", ids, {T, k});
  check_dtype(op, "ids", ids, DType::I32);
  if (groups < 1 || T % groups != 0)
    fail(ErrorKind::Shape, op, ": ", T, " rows do not split into ", groups, " equal groups");
  if (dlogits.defined()) {
    check_shape(op, "dlogits", dlogits, {T, E});
    check_dtype(op, "dlogits", dlogits, scores.dtype());
  }
  if (T == 0) return 0.0;
  double loss = 0;
  cpu::dispatch_float(scores.dtype(), op, [&](auto tag) {
    using V = decltype(tag);
    loss = aux_rows<V>(dlogits.defined() ? dlogits.data<V>() : nullptr, ids.data<int32_t>(), scores.data<V>(), T, E, k,
                       groups, coeff, dloss_scale, opt.score);
  });
  return loss;
}

}  // namespace xirang
