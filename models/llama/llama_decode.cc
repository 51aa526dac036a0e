// LLaMA's decoder (models/decode.h): the one-rank training forward of
// models/llama/llama.cc on the new rows only. q and k are rotated at their
// absolute positions (rope_qkv_forward's position offset) before the keys
// join the cache, so cached keys are stored rotated, as attention reads
// them in training. The rotary table covers every position the model sees
// (dims.max_seq_len), computed once.
#include "kernels/decode_attention.h"
#include "kernels/matmul.h"
#include "kernels/rope.h"
#include "models/decode.h"
#include "models/llama/llama.h"

namespace xirang {

namespace {

class LlamaDecoder final : public Decoder {
 public:
  LlamaDecoder(ModelChunk& chunk, Device device, int logits_rows)
      : Decoder(chunk, device, logits_rows), layers_(chunk.dims(), chunk.placement(), 1) {
    ParamList list(1, 0, dtype_, wide_);
    layers_.declare(list);
    const std::vector<Parameter> declared = list.take();
    std::vector<Parameter>& params = chunk.parameters();
    XR_CHECK(declared.size() == params.size(), "LLaMA decoder: the chunk has ", params.size(), " parameters, not ",
             declared.size());
    for (size_t i = 0; i < params.size(); ++i)
      XR_CHECK(declared[i].name == params[i].name, "LLaMA decoder: parameter ", i, " is '", params[i].name,
               "', not '", declared[i].name, "'");
    layers_.bind(params);
    allocate();
  }

 private:
  int64_t head_dim() const { return dims_.d_model / dims_.n_head; }
  int64_t qkv_width() const { return (int64_t(dims_.n_head) + 2 * dims_.kv_heads()) * head_dim(); }

  void layout(Arena& a) override {
    const int64_t T = max_len(), C = dims_.d_model, F = layers_.ffn_hidden, KVD = dims_.kv_heads() * head_dim();
    auto A = [&](Shape s, const char* what) { return a.alloc(s, dtype_, what); };
    x_ = A({T, C}, "decode residual");
    y_ = A({T, C}, "decode residual 2");
    ln_ = A({T, C}, "decode norm output");
    rstd_ = a.alloc({T}, wide_, "decode norm rstd");
    qkv_ = A({T, qkv_width()}, "decode qkv");
    att_ = A({T, C}, "decode attention output");
    gu_ = A({T, 2 * F}, "decode mlp gate and up");
    h_ = A({T, F}, "decode mlp swiglu");
    cos_ = a.alloc({T, head_dim() / 2}, wide_, "decode rotary cos");
    sin_ = a.alloc({T, head_dim() / 2}, wide_, "decode rotary sin");
    rope_ready_ = false;
    k_.clear();
    v_.clear();
    for (size_t l = 0; l < layers_.blocks.size(); ++l) {
      k_.push_back(A({1, T, KVD}, "key cache"));
      v_.push_back(A({1, T, KVD}, "value cache"));
    }
  }

  void run(const KernelContext& ctx, const Tensor& tokens, int64_t n, int64_t pos, Tensor logits) override {
    if (!rope_ready_) {
      rope_table(ctx, cos_, sin_, dims_.rope);
      rope_ready_ = true;
    }
    const int H = dims_.n_head, KV = dims_.kv_heads();
    const int64_t C = dims_.d_model;
    TpComm tp(TensorParallel{}, n);  // a group of one: the layers' one-rank paths
    Tensor x = x_.slice(0, n), y = y_.slice(0, n), ln = ln_.slice(0, n), rstd = rstd_.slice(0, n),
           qkv = qkv_.slice(0, n), att = att_.slice(0, n), gu = gu_.slice(0, n), h = h_.slice(0, n);
    Tensor qkv3 = qkv.view({1, n, qkv_width()});
    layers_.embed->forward(ctx, tp, x, tokens.view({1, n}));
    for (size_t l = 0; l < layers_.blocks.size(); ++l) {
      const LlamaLayers::Block& b = layers_.blocks[l];
      b.input_norm.forward(ctx, ln, Tensor(), rstd, x);
      b.attn.qkv_proj().forward(ctx, qkv, ln);
      rope_qkv_forward(ctx, qkv3, cos_, sin_, H, KV, n, pos);  // row i at position pos + i
      decode_attention_forward(ctx, att.view({1, n, C}), k_[l], v_[l], qkv3, pos, H, KV);
      b.attn.proj().forward_unsplit(ctx, y, att);
      b.post_norm.residual_forward(ctx, y, ln, Tensor(), rstd, y, x);  // y = attention + x; ln = norm(y)
      b.mlp.forward(ctx, tp, x, gu, h, ln, y);                          // x = y + mlp(ln)
    }
    const int64_t r = logits.size(0);
    Tensor lnf = ln.slice(n - r, n);
    layers_.norm->forward(ctx, lnf, Tensor(), rstd.slice(0, r), x.slice(n - r, n));
    linear_forward(ctx, logits, lnf, layers_.head_table().value, Tensor());
  }

  LlamaLayers layers_;
  Tensor x_, y_, ln_, rstd_;   // (T, C) x 3, (T)
  Tensor qkv_, att_;           // (T, (H + 2 KV) D), (T, C)
  Tensor gu_, h_;              // (T, 2F), (T, F)
  Tensor cos_, sin_;           // (T, D/2) rotary tables for every position
  bool rope_ready_ = false;
  std::vector<Tensor> k_, v_;  // per layer (1, T, KV D), keys rotated
};

}  // namespace

std::unique_ptr<Decoder> make_llama_decoder(ModelChunk& chunk, Device device, int logits_rows) {
  return std::make_unique<LlamaDecoder>(chunk, device, logits_rows);
}

}  // namespace xirang
