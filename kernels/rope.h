// kernels/rope.h: rotary position embeddings (RoPE) on query and key heads,
// in Hugging Face's rotate-half convention, with Llama 3.1's frequency
// scaling.
//
//   RopeConfig cfg{500000.0, RopeScaling::llama3(8, 1, 4, 8192)};
//   rope_table(ctx, cos, sin, cfg);                    // cos, sin (T_max, D/2), once per model
//   rope_qkv_forward(ctx, qkv, cos, sin, n_head, n_kv_head, T, 0);   // qkv (B, T, (H + 2 KV) D), in place
//   ...attention forward and backward...
//   rope_qkv_backward(ctx, dqkv, cos, sin, n_head, n_kv_head, T, 0);
//
// A head of D = 2 * cos.size(1) elements at position p is rotated pairwise:
// for i < D/2, with a = p * freq_i,
//   out_i       = x_i cos a - x_{i+D/2} sin a
//   out_{i+D/2} = x_{i+D/2} cos a + x_i sin a
// (q * cos + rotate_half(q) * sin in transformers' modeling_llama.py).
// freq_i = theta^(-2i/D), then rescaled by rope_scaling (rope_frequencies).
//
// Positions. The rows of x are B sequences of seq_len tokens, flattened:
// row r holds position pos_offset + r % seq_len. Training passes pos_offset
// 0; generation with a key/value cache passes the number of tokens already
// cached (and seq_len = the new tokens per sequence). A tensor-parallel rank
// holds a subset of the heads of every token, so its rows carry the same
// positions: the position depends only on the row, never on the head.
//
// Precision. The table is computed in double and stored in the compute
// dtype: F64 for F64 activations, else F32 (also beside 16-bit activations,
// where Hugging Face rounds cos and sin to bf16). transformers forms the
// frequencies and the angles p * freq in float32, so its angles carry an
// error of up to ~6e-8 p radians (5e-4 at p = 8192); ours are exact to
// double, and a comparison with it at long positions needs that slack. The rotation is computed
// in the compute type and each element rounded once. The backward is the
// rotation by -a (the transpose), applied to the gradient in place: the
// gradient of the rotated heads becomes that of the heads before rotation.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/context.h"
#include "kernels/context_split.h"

namespace xirang {

// rope_scaling of a Hugging Face config. None: the plain frequencies.
// Llama3 (rope_type "llama3", Llama 3.1+): with wavelength w = 2 pi / freq,
// low = original / low_freq_factor and high = original / high_freq_factor,
// a frequency with w < high is kept, one with w > low is divided by factor,
// and in between freq' = (1 - s) freq / factor + s freq with
// s = (original / w - low_freq_factor) / (high_freq_factor - low_freq_factor).
struct RopeScaling {
  enum class Type { None, Llama3 };
  Type type = Type::None;
  // Read only under Llama3; the defaults are Llama 3.1's.
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192.0;

  static RopeScaling llama3(double factor, double low_freq_factor, double high_freq_factor,
                            double original_max_position_embeddings) {
    return {Type::Llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings};
  }
};

struct RopeConfig {
  double theta = 10000.0;  // rope_theta: 10000 (Llama 2), 500000 (Llama 3)
  RopeScaling scaling;
};

// The D/2 angular frequencies freq_i (radians per position) of a head of
// head_dim = D elements, in double. Fails (ErrorKind::Config) on an odd or
// non-positive head_dim, theta <= 1, or Llama3 scaling with factor <= 0,
// low_freq_factor >= high_freq_factor, or original_max_position_embeddings <= 0.
std::vector<double> rope_frequencies(const RopeConfig& cfg, int64_t head_dim);

// cos[p][i] = cos(p * freq_i), sin[p][i] = sin(p * freq_i) for positions
// p in [0, T_max): cos, sin (T_max, D/2), F32 or F64, on ctx's device.
// The angle and its cosine and sine are computed in double, then stored.
void rope_table(const KernelContext& ctx, Tensor cos, Tensor sin, const RopeConfig& cfg);

// Rotates every head of x in place: x (B, T, H*D), or any (rows, H*D) with
// rows a multiple of seq_len. Needs pos_offset + seq_len <= T_max.
void rope_forward(const KernelContext& ctx, Tensor x, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                  int64_t pos_offset);
// dx = the rotation of dx by -angle, in place (dx was d loss / d rope(x)).
void rope_backward(const KernelContext& ctx, Tensor dx, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                   int64_t pos_offset);

// The packed attention input: rows of qkv (B, T, (n_head + 2 n_kv_head) D)
// hold [q heads | k heads | v heads]; the q and k heads are rotated in
// place, v is left as it is. The same on a tensor-parallel rank with its own
// head counts.
void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, int64_t seq_len, int64_t pos_offset);
void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, int64_t seq_len, int64_t pos_offset);
// A context-parallel rank's packed rows (kernels/context_split.h): qkv
// (B * split.local_rows(), ...) in any shape with that many rows, row r at
// position split.position(rank, r % split.local_rows()); the table covers
// the whole sequence (T_max >= split.seq_len).
void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, const ContextSplit& split, int rank);
void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, const ContextSplit& split, int rank);

}  // namespace xirang
