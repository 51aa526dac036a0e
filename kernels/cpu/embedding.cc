// CPU token + position embedding: the sharded pieces (lookup over a slice of
// the vocabulary, positions over a run of rows) and embedding_forward/backward
// as their composition on one rank.
//
// F32 and F64 gradients add row by row in place. With 16-bit activations the
// backward passes sum each table row's contributions in double, in row order,
// and round once into the gradient (16-bit or F32).
#include "kernels/embedding.h"

#include <algorithm>

#include "kernels/cpu/common.h"
#include "kernels/embedding_checks.h"
#include "kernels/row_positions.h"

namespace xirang {

using cpu::dispatch_storage;
using cpu::is_16bit_v;
using cpu::load;
using cpu::store;
using namespace embedding_checks;

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

// `t` viewed as (N, C) rows. Callers may pass (B, T, C) activations or
// (N, C) row slices; only the row width and the row count matter.
Tensor as_rows(const char* op, const char* what, const Tensor& t, int64_t N, int64_t C) {
  check_rows(op, what, t, N, C);
  return t.view({N, C});
}

// Adds to one gradient row (C) the double sum of rows `idx[0..n)` of g, in
// that order, rounding once per element.
template <class E, class G>
void add_rows_once(G* a, const E* g, const int64_t* idx, int64_t n, int64_t C, double* acc) {
  std::fill(acc, acc + C, 0.0);
  for (int64_t k = 0; k < n; ++k) {
    const E* gi = g + idx[k] * C;
    for (int64_t j = 0; j < C; ++j) acc[j] += load(gi[j]);
  }
  for (int64_t j = 0; j < C; ++j) a[j] = store<G>(double(load(a[j])) + acc[j]);
}

// 16-bit lookup backward: the rows of dout are grouped by the table row they
// hit (a stable counting sort, so each group stays in row order), then each
// table row is summed in double and rounded once. Parallel over table rows.
template <class E, class G>
void lookup_backward_grouped(const E* pd, const int32_t* tk, int64_t N, int64_t C, int64_t vocab_begin, int64_t Vs,
                             G* pte) {
  // start (Vs + 1): group offsets; order (N): dout rows by group; rows (<= N): the groups present.
  int64_t* start = cpu::thread_scratch<int64_t, cpu::kScratchIndex>(size_t(Vs + 1 + 2 * N));
  int64_t* order = start + Vs + 1;
  int64_t* rows = order + N;
  std::fill(start, start + Vs + 1, int64_t(0));
  for (int64_t i = 0; i < N; ++i) {
    int64_t r = int64_t(tk[i]) - vocab_begin;
    if (r >= 0 && r < Vs) ++start[r + 1];
  }
  int64_t n_rows = 0;
  for (int64_t r = 0; r < Vs; ++r) {
    if (start[r + 1] > 0) rows[n_rows++] = r;
    start[r + 1] += start[r];
  }
  // Placing the rows moves start[r] from group r's beginning to its end.
  for (int64_t i = 0; i < N; ++i) {
    const int64_t r = int64_t(tk[i]) - vocab_begin;
    if (r >= 0 && r < Vs) order[start[r]++] = i;
  }
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t k = 0; k < n_rows; ++k) {
    const int64_t r = rows[k];
    const int64_t end = start[r], begin = r == 0 ? 0 : start[r - 1];
    add_rows_once(pte + r * C, pd, order + begin, end - begin, C,
                  cpu::thread_scratch<double, cpu::kScratchReduce>(size_t(C)));
  }
}

// 16-bit positions backward: the table row of run row i0 gets rows i = i0,
// i0 + seq_len, ... (the same row of each sequence), summed in double in row order.
template <class E, class G>
void positions_backward_grouped(const E* pd, int64_t N, int64_t C, const RowPositions& pos, G* ppe) {
  const int64_t P = std::min(N, pos.seq_len);
#pragma omp parallel for schedule(static)
  for (int64_t i0 = 0; i0 < P; ++i0) {
    int64_t* idx = cpu::thread_scratch<int64_t, cpu::kScratchIndex>(size_t(N / pos.seq_len + 1));
    int64_t n = 0;
    for (int64_t i = i0; i < N; i += pos.seq_len) idx[n++] = i;
    add_rows_once(ppe + pos(i0) * C, pd, idx, n, C, cpu::thread_scratch<double, cpu::kScratchReduce>(size_t(C)));
  }
}

// x (N, C) += wpe[pos(i)] for row i (checked by the callers: positions in the table).
void add_positions_rows(const char* op, Tensor x, const Tensor& wpe, const RowPositions& pos) {
  const int64_t C = wpe.size(1);
  if (x.rank() < 1 || x.size(-1) != C)
    fail(ErrorKind::Shape, op, ": x ", x.shape().str(), " does not have rows of width ", C);
  check_dtype(op, "x", x, wpe.dtype());
  Tensor x2 = x.flat2d();
  const int64_t N = x2.size(0);
  dispatch_storage(wpe.dtype(), op, [&](auto tag) {
    using E = decltype(tag);
    const E* ppe = wpe.data<E>();
    E* px = x2.data<E>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const E* p = ppe + pos(i) * C;
      E* o = px + i * C;
      for (int64_t j = 0; j < C; ++j) o[j] = store<E>(load(o[j]) + load(p[j]));
    }
  });
}

// dwpe[pos(i)] += dx[i].
void add_positions_backward_rows(const char* op, Tensor dwpe, const Tensor& dx, const RowPositions& pos) {
  const int64_t C = dwpe.size(1);
  if (dx.rank() < 1 || dx.size(-1) != C)
    fail(ErrorKind::Shape, op, ": dx ", dx.shape().str(), " does not have rows of width ", C);
  cpu::check_grad_dtype(op, "dwpe", dwpe, dx.dtype());
  Tensor d2 = dx.flat2d();
  const int64_t N = d2.size(0);
  dispatch_storage(dx.dtype(), op, [&](auto tag) {
    using E = decltype(tag);
    const E* pd = d2.data<E>();
    if constexpr (is_16bit_v<E>) {
      cpu::dispatch_grad<E>(dwpe.dtype(), [&](auto gtag) {
        using G = decltype(gtag);
        positions_backward_grouped(pd, N, C, pos, dwpe.data<G>());
      });
    } else {
      E* ppe = dwpe.data<E>();
      // Several rows share a position when the run spans more than one
      // sequence: same column-block scheme as the lookup backward.
#pragma omp parallel for schedule(static)
      for (int64_t j0 = 0; j0 < C; j0 += kColBlock) {
        const int64_t j1 = std::min(C, j0 + kColBlock);
        for (int64_t i = 0; i < N; ++i) {
          const E* g = pd + i * C;
          E* p = ppe + pos(i) * C;
          for (int64_t j = j0; j < j1; ++j) p[j] += g[j];
        }
      }
    }
  });
}

}  // namespace

void embedding_lookup(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                      int64_t vocab_begin, int64_t vocab_size) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
  XR_ON_CUDA(ctx, embedding_lookup(ctx, out, tokens, wte, vocab_begin, vocab_size));
  const char* op = "embedding_lookup";
  cpu::require_cpu(ctx, op);
  check_table(op, "wte", wte);
  check_shard(op, vocab_begin, vocab_size);
  const int64_t N = tokens.numel(), Vs = wte.size(0), C = wte.size(1);
  Tensor o2 = as_rows(op, "out", out, N, C);
  check_dtype(op, "out", out, wte.dtype());
  check_tokens(op, tokens, vocab_size);
  dispatch_storage(wte.dtype(), op, [&](auto tag) {
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
      else std::fill(o, o + C, E{});
    }
  });
}

void embedding_lookup_backward(const KernelContext& ctx, Tensor dwte, const Tensor& dout, const Tensor& tokens,
                               int64_t vocab_begin, int64_t vocab_size) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
  XR_ON_CUDA(ctx, embedding_lookup_backward(ctx, dwte, dout, tokens, vocab_begin, vocab_size));
  const char* op = "embedding_lookup_backward";
  cpu::require_cpu(ctx, op);
  check_table(op, "dwte", dwte);
  check_shard(op, vocab_begin, vocab_size);
  const int64_t N = tokens.numel(), Vs = dwte.size(0), C = dwte.size(1);
  Tensor d2 = as_rows(op, "dout", dout, N, C);
  cpu::check_grad_dtype(op, "dwte", dwte, dout.dtype());
  check_tokens(op, tokens, vocab_size);
  dispatch_storage(dout.dtype(), op, [&](auto tag) {
    using E = decltype(tag);
    const int32_t* tk = tokens.data<int32_t>();
    const E* pd = d2.data<E>();
    if constexpr (is_16bit_v<E>) {
      cpu::dispatch_grad<E>(dwte.dtype(), [&](auto gtag) {
        using G = decltype(gtag);
        lookup_backward_grouped(pd, tk, N, C, vocab_begin, Vs, dwte.data<G>());
      });
    } else {
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
    }
  });
}

void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, int64_t seq_len, int64_t row_offset) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
  XR_ON_CUDA(ctx, add_positions(ctx, x, wpe, seq_len, row_offset));
  const char* op = "add_positions";
  cpu::require_cpu(ctx, op);
  check_table(op, "wpe", wpe);
  check_positions(op, "wpe", wpe, wpe.size(1), seq_len, row_offset);
  add_positions_rows(op, x, wpe, RowPositions::plain(seq_len, row_offset));
}

void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, int64_t seq_len,
                            int64_t row_offset) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
  XR_ON_CUDA(ctx, add_positions_backward(ctx, dwpe, dx, seq_len, row_offset));
  const char* op = "add_positions_backward";
  cpu::require_cpu(ctx, op);
  check_table(op, "dwpe", dwpe);
  check_positions(op, "dwpe", dwpe, dwpe.size(1), seq_len, row_offset);
  add_positions_backward_rows(op, dwpe, dx, RowPositions::plain(seq_len, row_offset));
}

void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, const ContextSplit& split, int rank,
                   int64_t row_offset) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
  XR_ON_CUDA(ctx, add_positions(ctx, x, wpe, split, rank, row_offset));
  const char* op = "add_positions";
  cpu::require_cpu(ctx, op);
  check_table(op, "wpe", wpe);
  check_context_positions(op, "wpe", wpe, split, rank, row_offset);
  add_positions_rows(op, x, wpe, RowPositions::context(split, rank, row_offset));
}

void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, const ContextSplit& split,
                            int rank, int64_t row_offset) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
  XR_ON_CUDA(ctx, add_positions_backward(ctx, dwpe, dx, split, rank, row_offset));
  const char* op = "add_positions_backward";
  cpu::require_cpu(ctx, op);
  check_table(op, "dwpe", dwpe);
  check_context_positions(op, "dwpe", dwpe, split, rank, row_offset);
  add_positions_backward_rows(op, dwpe, dx, RowPositions::context(split, rank, row_offset));
}

// The single-rank ops keep their own checks (and messages, which name
// embedding_forward/backward and the (B, T) layout); the pieces then see
// consistent inputs. Each output element gets the same additions in the same
// order as the former fused loops, so results are bitwise unchanged.
void embedding_forward(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                       const Tensor& wpe) {
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
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
  OpScope timed(ctx.timeline, ctx.cuda_stream, OpKind::Embedding);
  cpu::require_cpu(ctx, "embedding_backward");
  if (tokens.rank() != 2)
    fail(ErrorKind::Shape, "embedding_backward: tokens must be (B, T), got ", tokens.shape().str());
  check_table("embedding_backward", "dwte", dwte);
  int64_t B = tokens.size(0), T = tokens.size(1), V = dwte.size(0), C = dwte.size(1);
  check_shape("embedding_backward", "dout", dout, {B, T, C});
  if (dwpe.rank() != 2 || dwpe.size(0) < T || dwpe.size(1) != C)
    fail(ErrorKind::Shape, "embedding_backward: dwpe ", dwpe.shape().str(), " cannot cover ", T, " positions of width ", C);
  cpu::check_grad_dtype("embedding_backward", "dwte", dwte, dout.dtype());
  cpu::check_grad_dtype("embedding_backward", "dwpe", dwpe, dout.dtype());
  check_tokens("embedding_backward", tokens, V);
  if (B * T == 0) return;
  Tensor rows = dout.view({B * T, C});
  embedding_lookup_backward(ctx, dwte, rows, tokens.view({B * T}), 0, V);
  add_positions_backward(ctx, dwpe, rows, T, 0);
}

}  // namespace xirang
