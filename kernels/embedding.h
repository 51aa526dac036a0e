// kernels/embedding.h: token plus learned position embedding.
//
//   embedding_forward(ctx, out, tokens, wte, wpe);     // tokens (B, T) int32 -> out (B, T, C)
//   embedding_backward(ctx, dwte, dwpe, dout, tokens); // dwte, dwpe accumulate
//
// Tables and activations share one of F32, F64, BF16, F16. The table
// gradients dwte and dwpe have that dtype or, beside 16-bit activations, F32;
// with 16-bit activations each table row's contributions are summed in
// double, in row order, and added with one rounding.
#pragma once

#include "kernels/context.h"
#include "kernels/context_split.h"

namespace xirang {

// out[b, t] = wte[tokens[b, t]] + wpe[t]; wte (V, C), wpe (>= T, C).
void embedding_forward(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                       const Tensor& wpe);
// dwte[tokens[b, t]] += dout[b, t]; dwpe[t] += sum over b of dout[b, t].
void embedding_backward(const KernelContext& ctx, Tensor dwte, Tensor dwpe, const Tensor& dout, const Tensor& tokens);

}  // namespace xirang

// The pieces that tensor and sequence parallelism compose (embedding_forward
// is lookup + positions on one rank):
namespace xirang {

// out (N, C) = rows of the token-table shard wte (V_shard, C) that hold
// tokens (N) int32: a token t with vocab_begin <= t < vocab_begin + V_shard
// gets wte[t - vocab_begin], any other token a zero row (another rank of the
// tensor-parallel group holds it). Tokens outside [0, vocab_size) are a Data error.
void embedding_lookup(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                      int64_t vocab_begin, int64_t vocab_size);
// dwte[t - vocab_begin] += dout[i] for the tokens this shard holds.
void embedding_lookup_backward(const KernelContext& ctx, Tensor dwte, const Tensor& dout, const Tensor& tokens,
                               int64_t vocab_begin, int64_t vocab_size);
// x (N, C) += wpe[(row_offset + i) % seq_len] for row i: the rows are a
// contiguous run of the flattened (B * seq_len) token rows starting at row_offset.
void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, int64_t seq_len, int64_t row_offset);
// dwpe[(row_offset + i) % seq_len] += dx[i].
void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, int64_t seq_len,
                            int64_t row_offset);
// A context-parallel rank's rows (kernels/context_split.h): x's rows are a
// contiguous run of the flattened (B * split.local_rows()) rows starting at
// row_offset, and row r (counted from the start of the flattened rows)
// reads wpe[split.position(rank, r % split.local_rows())]; wpe (>= T, C).
void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, const ContextSplit& split, int rank,
                   int64_t row_offset);
// dwpe[split.position(rank, r % split.local_rows())] += dx[i], r = row_offset + i.
void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, const ContextSplit& split,
                            int rank, int64_t row_offset);

}  // namespace xirang
