// models/decode.h: autoregressive generation on one rank, with a key/value
// cache, and the sampling of the next token.
//
// A Decoder runs a whole model (a ModelChunk of every layer with the
// embedding and the head, on one rank: no tensor-parallel split) over new
// tokens only: each call embeds them at positions [position(), position() +
// n), runs every block on those rows alone, each layer's attention reading
// the keys and values of all earlier positions from its cache
// (kernels/decode_attention.h) after appending its own, and returns the
// logits of the last rows. A prompt goes through once (prefill), then one
// token per call. It reads the chunk's parameters in place (the chunk keeps
// them; nothing is copied) and allocates its own buffers once, for
// dims.max_seq_len positions, on the device of `device`; nothing is
// allocated per call.
//
// Each block mirrors the training forward of one rank (the same layers and
// kernels in the same order: the fused bias and residual adds of GPT-2 and
// LLaMA on one rank), so the logits of token t equal row t of a training
// forward over the whole sequence up to the order of float sums inside the
// matrix products (tests/models/decode_test.cc: relative 1e-5 in fp32).
//
//   std::unique_ptr<Decoder> dec = make_decoder(*chunk, Device::CPU);   // chunk: parameters laid out and loaded
//   Tensor logits = dec->forward(ctx, prompt.data(), prompt.size());    // (1, padded_vocab) on the device
//   for (int i = 0; i < n; ++i) {
//     int32_t next = sample_token(logits_to_host(ctx, logits, 0, vocab), {.temperature = 0.8, .top_k = 40,
//                                 .seed = 7}, i);
//     logits = dec->forward(ctx, &next, 1);
//   }
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "kernels/context.h"
#include "models/model.h"

namespace xirang {

class Decoder {
 public:
  virtual ~Decoder() = default;
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  const ModelDims& dims() const { return dims_; }
  // Positions the model can see: dims.max_seq_len (model.seq_len).
  int64_t max_len() const { return dims_.max_seq_len; }
  // Tokens in the cache: the position of the next token.
  int64_t position() const { return pos_; }
  // Forgets the cache: the next forward starts a new sequence at position 0.
  void reset() { pos_ = 0; }

  // Runs n >= 1 new tokens (host int32 ids in [0, vocab_size)) at positions
  // [position(), position() + n), which must fit max_len() (a Usage error
  // otherwise), and returns the logits (r, padded_vocab) of the last
  // r = min(n, logits_rows) of them, on the model's device, valid until the
  // next call. The padded columns past vocab_size are not logits of tokens.
  Tensor forward(const KernelContext& ctx, const int32_t* tokens, int64_t n);

 protected:
  Decoder(const ModelChunk& chunk, Device device, int logits_rows);
  // Lays out the architecture's buffers (called twice: measuring, then real).
  virtual void layout(Arena& arena) = 0;
  // The model over rows [0, n) of `tokens` (device int32, (n)) at positions
  // [pos, pos + n); the logits of the last logits.size(0) rows into `logits`.
  virtual void run(const KernelContext& ctx, const Tensor& tokens, int64_t n, int64_t pos, Tensor logits) = 0;
  // Carves the common buffers and calls layout(): the constructor of the
  // architecture's decoder calls it once its members exist.
  void allocate();

  ModelDims dims_;
  DType dtype_, wide_;
  Device device_;
  int logits_rows_;

 private:
  void carve(Arena& arena);
  Arena arena_;
  Tensor tokens_;  // (max_len) int32
  Tensor logits_;  // (logits_rows, padded_vocab)
  int64_t pos_ = 0;
};

// The decoder of `chunk`'s architecture (ModelArch::make_decoder). The chunk must hold
// the whole model on one rank with its parameters laid out on `device`; it
// must outlive the decoder. logits_rows: how many of a call's last rows get
// logits (1 for generation; tests ask for all). A Config error when the
// architecture has no decoder or the chunk is not a whole one-rank model.
std::unique_ptr<Decoder> make_decoder(ModelChunk& chunk, Device device, int logits_rows = 1);

// The first `n` logits of row `row` of `logits` (any float dtype, any
// device) as host floats.
std::vector<float> logits_to_host(const KernelContext& ctx, const Tensor& logits, int64_t row, int64_t n);

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (the largest logit, the lowest id on a tie)
  int top_k = 0;             // sample among the k largest logits; 0: all
  uint64_t seed = 0;
};

// The next token from one row of logits: with temperature 0 the argmax;
// otherwise a draw from softmax(logits / temperature) restricted to the
// top_k largest (ties broken by the lower id), computed in double in a fixed
// order, with the uniform number rng_uniform(seed, stream, draw) (core/rng.h)
// so that the same (logits, options, draw) always gives the same token.
// Throws a Usage error for a negative or non-finite temperature or a
// negative top_k.
int32_t sample_token(const std::vector<float>& logits, const SamplingOptions& options, uint64_t draw);

}  // namespace xirang
