// CPU token + position embedding: the sharded pieces (lookup over a slice of
// the vocabulary, positions over a run of rows) and embedding_forward/backward
// as their composition on one rank.
#include "kernels/embedding.h"

#include <algorithm>

#include "kernels/cpu/common.h"

namespace xirang {

using cpu::dispatch_float;

namespace {

// Column block of the backward passes: each thread owns whole blocks of
// columns and walks the rows in order, so repeated tokens (or positions) add
// up without races and in the same order whatever the thread count.
constexpr int64_t kColBlock = 16;

void check_tokens(const char* op, const Tensor& tokens, int64_t V) {
  check_dtype(op, "tokens", tokens, DType::I32);
  const int32_t* tk = tokens.data<int32_t>();
  for (int64_t i = 0; i < tokens.numel(); ++i)
    if (tk[i] < 0 || tk[i] >= V)
      fail(ErrorKind::Data, op, ": token id ", tk[i], " at position ", i, " is outside the vocabulary [0, ", V, ")");
}

// A table (rows, C) of the op's dtype: wte, wpe or their gradients.
void check_table(const char* op, const char* what, const Tensor& t) {
  if (t.rank() != 2) fail(ErrorKind::Shape, op, ": ", what, " must be a 2-D table, got ", t.shape().str());
}

// `t` viewed as (N, C) rows. Callers may pass (B, T, C) activations or
// (N, C) row slices; only the row width and the row count matter.
Tensor as_rows(const char* op, const char* what, const Tensor& t, int64_t N, int64_t C) {
  if (t.rank() < 1 || t.size(-1) != C || t.numel() != N * C)
    fail(ErrorKind::Shape, op, ": ", what, " ", t.shape().str(), " is not ", N, " rows of width ", C);
  return t.view({N, C});
}

void check_shard(const char* op, int64_t vocab_begin, int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_begin < 0)
    fail(ErrorKind::Shape, op, ": vocab_begin ", vocab_begin, " and vocab_size ", vocab_size,
         " must satisfy vocab_begin >= 0 and vocab_size > 0");
}

void check_positions(const char* op, const char* what, const Tensor& table, int64_t C, int64_t seq_len,
                     int64_t row_offset) {
  check_table(op, what, table);
  if (seq_len <= 0 || row_offset < 0)
    fail(ErrorKind::Shape, op, ": seq_len ", seq_len, " must be positive and row_offset ", row_offset,
         " non-negative");
  if (table.size(0) < seq_len || table.size(1) != C)
    fail(ErrorKind::Shape, op, ": ", what, " ", table.shape().str(), " cannot cover ", seq_len,
         " positions of width ", C);
}

}  // namespace

void embedding_lookup(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                      int64_t vocab_begin, int64_t vocab_size) {
  const char* op = "embedding_lookup";
  cpu::require_cpu(ctx, op);
  check_table(op, "wte", wte);
  check_shard(op, vocab_begin, vocab_size);
  const int64_t N = tokens.numel(), Vs = wte.size(0), C = wte.size(1);
  Tensor o2 = as_rows(op, "out", out, N, C);
  check_dtype(op, "out", out, wte.dtype());
  check_tokens(op, tokens, vocab_size);
  dispatch_float(wte.dtype(), op, [&](auto tag) {
    using E = decltype(tag);
    const int32_t* tk = tokens.data<int32_t>();
    const E* pte = wte.data<E>();
    E* po = o2.data<E>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      E* o = po + i * C;
      int64_t r = int64_t(tk[i]) - vocab_begin;
      // A token of another shard contributes zero here; the tensor-parallel
      // all-reduce of the outputs then gives every row exactly one table row.
      if (r >= 0 && r < Vs) std::copy(pte + r * C, pte + (r + 1) * C, o);
      else std::fill(o, o + C, E(0));
    }
  });
}

void embedding_lookup_backward(const KernelContext& ctx, Tensor dwte, const Tensor& dout, const Tensor& tokens,
                               int64_t vocab_begin, int64_t vocab_size) {
  const char* op = "embedding_lookup_backward";
  cpu::require_cpu(ctx, op);
  check_table(op, "dwte", dwte);
  check_shard(op, vocab_begin, vocab_size);
  const int64_t N = tokens.numel(), Vs = dwte.size(0), C = dwte.size(1);
  Tensor d2 = as_rows(op, "dout", dout, N, C);
  check_dtype(op, "dout", dout, dwte.dtype());
  check_tokens(op, tokens, vocab_size);
  dispatch_float(dwte.dtype(), op, [&](auto tag) {
    using E = decltype(tag);
    const int32_t* tk = tokens.data<int32_t>();
    const E* pd = d2.data<E>();
    E* pte = dwte.data<E>();
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < C; j0 += kColBlock) {
      const int64_t j1 = std::min(C, j0 + kColBlock);
      for (int64_t i = 0; i < N; ++i) {
        int64_t r = int64_t(tk[i]) - vocab_begin;
        if (r < 0 || r >= Vs) continue;  // another shard's token
        const E* g = pd + i * C;
        E* a = pte + r * C;
        for (int64_t j = j0; j < j1; ++j) a[j] += g[j];
      }
    }
  });
}

void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, int64_t seq_len, int64_t row_offset) {
  const char* op = "add_positions";
  cpu::require_cpu(ctx, op);
  check_table(op, "wpe", wpe);
  const int64_t C = wpe.size(1);
  if (x.rank() < 1 || x.size(-1) != C)
    fail(ErrorKind::Shape, op, ": x ", x.shape().str(), " does not have rows of width ", C);
  check_positions(op, "wpe", wpe, C, seq_len, row_offset);
  check_dtype(op, "x", x, wpe.dtype());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0);
  dispatch_float(wpe.dtype(), op, [&](auto tag) {
    using E = decltype(tag);
    const E* ppe = wpe.data<E>();
    E* px = x2.data<E>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const E* p = ppe + ((row_offset + i) % seq_len) * C;
      E* o = px + i * C;
      for (int64_t j = 0; j < C; ++j) o[j] += p[j];
    }
  });
}

void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, int64_t seq_len,
                            int64_t row_offset) {
  const char* op = "add_positions_backward";
  cpu::require_cpu(ctx, op);
  check_table(op, "dwpe", dwpe);
  const int64_t C = dwpe.size(1);
  if (dx.rank() < 1 || dx.size(-1) != C)
    fail(ErrorKind::Shape, op, ": dx ", dx.shape().str(), " does not have rows of width ", C);
  check_positions(op, "dwpe", dwpe, C, seq_len, row_offset);
  check_dtype(op, "dx", dx, dwpe.dtype());
  Tensor d2 = dx.flat2d();
  const int64_t N = d2.size(0);
  dispatch_float(dwpe.dtype(), op, [&](auto tag) {
    using E = decltype(tag);
    const E* pd = d2.data<E>();
    E* ppe = dwpe.data<E>();
    // Several rows share a position when the run spans more than one
    // sequence: same column-block scheme as the lookup backward.
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < C; j0 += kColBlock) {
      const int64_t j1 = std::min(C, j0 + kColBlock);
      for (int64_t i = 0; i < N; ++i) {
        const E* g = pd + i * C;
        E* p = ppe + ((row_offset + i) % seq_len) * C;
        for (int64_t j = j0; j < j1; ++j) p[j] += g[j];
      }
    }
  });
}

// The single-rank ops keep their own checks (and messages, which name
// embedding_forward/backward and the (B, T) layout); the pieces then see
// consistent inputs. Each output element gets the same additions in the same
// order as the former fused loops, so results are bitwise unchanged.
void embedding_forward(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                       const Tensor& wpe) {
  cpu::require_cpu(ctx, "embedding_forward");
  if (tokens.rank() != 2) fail(ErrorKind::Shape, "embedding_forward: tokens must be (B, T), got ", tokens.shape().str());
  check_table("embedding_forward", "wte", wte);
  int64_t B = tokens.size(0), T = tokens.size(1), V = wte.size(0), C = wte.size(1);
  check_shape("embedding_forward", "out", out, {B, T, C});
  if (wpe.rank() != 2 || wpe.size(0) < T || wpe.size(1) != C)
    fail(ErrorKind::Shape, "embedding_forward: wpe ", wpe.shape().str(), " cannot cover ", T, " positions of width ", C);
  check_dtype("embedding_forward", "wpe", wpe, wte.dtype());
  check_dtype("embedding_forward", "out", out, wte.dtype());
  check_tokens("embedding_forward", tokens, V);
  if (B * T == 0) return;
  Tensor rows = out.view({B * T, C});
  embedding_lookup(ctx, rows, tokens.view({B * T}), wte, 0, V);
  add_positions(ctx, rows, wpe, T, 0);
}

void embedding_backward(const KernelContext& ctx, Tensor dwte, Tensor dwpe, const Tensor& dout, const Tensor& tokens) {
  cpu::require_cpu(ctx, "embedding_backward");
  if (tokens.rank() != 2)
    fail(ErrorKind::Shape, "embedding_backward: tokens must be (B, T), got ", tokens.shape().str());
  check_table("embedding_backward", "dwte", dwte);
  int64_t B = tokens.size(0), T = tokens.size(1), V = dwte.size(0), C = dwte.size(1);
  check_shape("embedding_backward", "dout", dout, {B, T, C});
  if (dwpe.rank() != 2 || dwpe.size(0) < T || dwpe.size(1) != C)
    fail(ErrorKind::Shape, "embedding_backward: dwpe ", dwpe.shape().str(), " cannot cover ", T, " positions of width ", C);
  check_dtype("embedding_backward", "dwpe", dwpe, dwte.dtype());
  check_dtype("embedding_backward", "dout", dout, dwte.dtype());
  check_tokens("embedding_backward", tokens, V);
  if (B * T == 0) return;
  Tensor rows = dout.view({B * T, C});
  embedding_lookup_backward(ctx, dwte, rows, tokens.view({B * T}), 0, V);
  add_positions_backward(ctx, dwpe, rows, T, 0);
}

}  // namespace xirang
