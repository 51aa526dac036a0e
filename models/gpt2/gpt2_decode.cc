// GPT-2's decoder (models/decode.h): the one-rank training forward of
// models/gpt2/gpt2.cc on the new rows only, with each block's keys and
// values cached. Layers are bound to the chunk's own parameters.
#include "kernels/decode_attention.h"
#include "kernels/matmul.h"
#include "models/decode.h"
#include "models/gpt2/gpt2.h"

namespace xirang {

namespace {

class Gpt2Decoder final : public Decoder {
 public:
  Gpt2Decoder(ModelChunk& chunk, Device device, int logits_rows)
      : Decoder(chunk, device, logits_rows), layers_(chunk.dims(), chunk.placement(), 1) {
    ParamList list(1, 0, dtype_, wide_);
    layers_.declare(list);
    const std::vector<Parameter> declared = list.take();
    std::vector<Parameter>& params = chunk.parameters();
    XR_CHECK(declared.size() == params.size(), "GPT-2 decoder: the chunk has ", params.size(), " parameters, not ",
             declared.size());
    for (size_t i = 0; i < params.size(); ++i)
      XR_CHECK(declared[i].name == params[i].name, "GPT-2 decoder: parameter ", i, " is '", params[i].name, "', not '",
               declared[i].name, "'");
    layers_.bind(params);
    allocate();
  }

 private:
  void layout(Arena& a) override {
    const int64_t T = max_len(), C = dims_.d_model, KVD = C;
    auto A = [&](Shape s, const char* what) { return a.alloc(s, dtype_, what); };
    x_ = A({T, C}, "decode residual");
    y_ = A({T, C}, "decode residual 2");
    ln_ = A({T, C}, "decode norm output");
    mean_ = a.alloc({T}, wide_, "decode norm mean");
    rstd_ = a.alloc({T}, wide_, "decode norm rstd");
    qkv_ = A({T, 3 * C}, "decode qkv");
    att_ = A({T, C}, "decode attention output");
    fch_ = A({T, 4 * C}, "decode mlp hidden");
    gelu_ = A({T, 4 * C}, "decode mlp gelu");
    k_.clear();
    v_.clear();
    for (size_t l = 0; l < layers_.blocks.size(); ++l) {
      k_.push_back(A({1, T, KVD}, "key cache"));
      v_.push_back(A({1, T, KVD}, "value cache"));
    }
  }

  void run(const KernelContext& ctx, const Tensor& tokens, int64_t n, int64_t pos, Tensor logits) override {
    const int64_t C = dims_.d_model;
    TpComm tp(TensorParallel{}, n);  // a group of one: the layers' one-rank paths
    Tensor x = x_.slice(0, n), y = y_.slice(0, n), ln = ln_.slice(0, n), mean = mean_.slice(0, n),
           rstd = rstd_.slice(0, n), qkv = qkv_.slice(0, n), att = att_.slice(0, n), fch = fch_.slice(0, n),
           gelu = gelu_.slice(0, n);
    layers_.wte->forward(ctx, tp, x, tokens.view({1, n}));
    layers_.wpe->forward(ctx, x, max_len(), pos);  // row i at position pos + i
    for (size_t l = 0; l < layers_.blocks.size(); ++l) {
      const GPT2Layers::Block& b = layers_.blocks[l];
      b.ln1.forward(ctx, ln, mean, rstd, x);
      b.attn.qkv_proj().forward(ctx, qkv, ln);
      decode_attention_forward(ctx, att.view({1, n, C}), k_[l], v_[l], qkv.view({1, n, 3 * C}), pos, dims_.n_head,
                               dims_.n_head);
      b.attn.proj().forward_unsplit(ctx, y, att);
      b.ln2.residual_forward(ctx, y, ln, mean, rstd, y, x);  // y = attention + x; ln = ln_2(y)
      b.mlp.forward(ctx, tp, x, fch, gelu, ln, y);           // x = y + mlp(ln)
    }
    const int64_t r = logits.size(0);
    Tensor last = x.slice(n - r, n), lnf = ln.slice(n - r, n);
    layers_.ln_f->forward(ctx, lnf, mean.slice(0, r), rstd.slice(0, r), last);
    linear_forward(ctx, logits, lnf, layers_.wte->table().value, Tensor());
  }

  GPT2Layers layers_;
  Tensor x_, y_, ln_, mean_, rstd_;  // (T, C), (T, C), (T, C), (T), (T)
  Tensor qkv_, att_;                 // (T, 3C), (T, C)
  Tensor fch_, gelu_;                // (T, 4C) each
  std::vector<Tensor> k_, v_;        // per layer (1, T, C)
};

}  // namespace

std::unique_ptr<Decoder> make_gpt2_decoder(ModelChunk& chunk, Device device, int logits_rows) {
  return std::make_unique<Gpt2Decoder>(chunk, device, logits_rows);
}

}  // namespace xirang
