// CPU token + position embedding.
#include "kernels/embedding.h"

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

namespace {
void check_tokens(const char* op, const Tensor& tokens, int64_t V) {
  check_dtype(op, "tokens", tokens, DType::I32);
  const int32_t* tk = tokens.data<int32_t>();
  for (int64_t i = 0; i < tokens.numel(); ++i)
    if (tk[i] < 0 || tk[i] >= V)
      fail(ErrorKind::Data, op, ": token id ", tk[i], " at position ", i, " is outside the vocabulary [0, ", V, ")");
}
}  // namespace

void embedding_forward(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                       const Tensor& wpe) {
  cpu::require_cpu(ctx, "embedding_forward");
  if (tokens.rank() != 2) fail(ErrorKind::Shape, "embedding_forward: tokens must be (B, T), got ", tokens.shape().str());
  int64_t B = tokens.size(0), T = tokens.size(1), V = wte.size(0), C = wte.size(1);
  check_shape("embedding_forward", "out", out, {B, T, C});
  if (wpe.rank() != 2 || wpe.size(0) < T || wpe.size(1) != C)
    fail(ErrorKind::Shape, "embedding_forward: wpe ", wpe.shape().str(), " cannot cover ", T, " positions of width ", C);
  check_dtype("embedding_forward", "wpe", wpe, wte.dtype());
  check_dtype("embedding_forward", "out", out, wte.dtype());
  check_tokens("embedding_forward", tokens, V);
  dispatch_float(wte.dtype(), "embedding_forward", [&](auto tag) {
    using E = decltype(tag);
    const int32_t* tk = tokens.data<int32_t>();
    const E* pte = wte.data<E>();
    const E* ppe = wpe.data<E>();
    E* po = out.data<E>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < B * T; ++i) {
      const E* a = pte + int64_t(tk[i]) * C;
      const E* p = ppe + (i % T) * C;
      E* o = po + i * C;
      for (int64_t j = 0; j < C; ++j) o[j] = a[j] + p[j];
    }
  });
}

void embedding_backward(const KernelContext& ctx, Tensor dwte, Tensor dwpe, const Tensor& dout, const Tensor& tokens) {
  cpu::require_cpu(ctx, "embedding_backward");
  int64_t B = tokens.size(0), T = tokens.size(1), V = dwte.size(0), C = dwte.size(1);
  check_shape("embedding_backward", "dout", dout, {B, T, C});
  if (dwpe.rank() != 2 || dwpe.size(0) < T || dwpe.size(1) != C)
    fail(ErrorKind::Shape, "embedding_backward: dwpe ", dwpe.shape().str(), " cannot cover ", T, " positions of width ", C);
  check_dtype("embedding_backward", "dwpe", dwpe, dwte.dtype());
  check_dtype("embedding_backward", "dout", dout, dwte.dtype());
  check_tokens("embedding_backward", tokens, V);
  dispatch_float(dwte.dtype(), "embedding_backward", [&](auto tag) {
    using E = decltype(tag);
    const int32_t* tk = tokens.data<int32_t>();
    const E* pd = dout.data<E>();
    E* pte = dwte.data<E>();
    E* ppe = dwpe.data<E>();
    // Parallel over columns, rows in order: repeated tokens add up without
    // races and in the same order on every run.
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < C; j0 += 16) {
      int64_t j1 = std::min(C, j0 + 16);
      for (int64_t i = 0; i < B * T; ++i) {
        const E* g = pd + i * C;
        E* a = pte + int64_t(tk[i]) * C;
        E* p = ppe + (i % T) * C;
        for (int64_t j = j0; j < j1; ++j) {
          a[j] += g[j];
          p[j] += g[j];
        }
      }
    }
  });
}

}  // namespace xirang
