// The generation loop of every decoder spec (models/decode.h): the one-rank
// training forward of decoder_chunk.cc on the new rows only, with each
// block's keys and values cached. With rotary tables q and k are rotated at
// their absolute positions (rope_qkv_forward's position offset) before the
// keys join the cache, so cached keys are stored rotated, as attention reads
// them in training; the table covers every position the model sees
// (dims.max_seq_len), computed once. A q/k norm normalizes q and k in
// place before the rotation. Layers are bound to the chunk's own
// parameters.
#include "kernels/decode_attention.h"
#include "kernels/matmul.h"
#include "kernels/rope.h"
#include "models/decode.h"
#include "models/decoder/decoder_chunk.h"

namespace xirang {

namespace {

class SpecDecoder final : public Decoder {
 public:
  SpecDecoder(const DecoderSpec& spec, ModelChunk& chunk, Device device, int logits_rows)
      : Decoder(chunk, device, logits_rows), layers_(spec, chunk.dims(), chunk.placement(), 1) {
    ParamList list(1, 0, dtype_, wide_);
    layers_.declare(list);
    const std::vector<Parameter> declared = list.take();
    std::vector<Parameter>& params = chunk.parameters();
    XR_CHECK(declared.size() == params.size(), spec.name, " decoder: the chunk has ", params.size(),
             " parameters, not ", declared.size());
    for (size_t i = 0; i < params.size(); ++i)
      XR_CHECK(declared[i].name == params[i].name, spec.name, " decoder: parameter ", i, " is '", params[i].name,
               "', not '", declared[i].name, "'");
    layers_.bind(params);
    allocate();
  }

 private:
  int64_t head_dim() const { return layers_.spec.resolved_head_dim(dims_); }
  int64_t qkv_width() const { return (int64_t(dims_.n_head) + 2 * dims_.kv_heads()) * head_dim(); }

  void layout(Arena& a) override {
    const int64_t T = max_len(), C = dims_.d_model, KVD = dims_.kv_heads() * head_dim();
    auto A = [&](Shape s, const char* what) { return a.alloc(s, dtype_, what); };
    x_ = A({T, C}, "decode residual");
    y_ = A({T, C}, "decode residual 2");
    ln_ = A({T, C}, "decode norm output");
    // The feed-forward's and the norms' own activation lists give the hidden widths.
    ActList list;
    NormActs norm;
    if (!layers_.blocks.empty()) {
      layers_.blocks[0].norm1.activations(list, norm, T, C, "decode norm");
      layers_.blocks[0].ffn->activations(list, ffn_, T, 1, dtype_);
    } else {
      layers_.final_norm->activations(list, norm, T, C, "decode norm");
    }
    for (const ActSpec& s : list)
      if (s.tensor != &norm.y) *s.tensor = a.alloc(s.shape, s.wide ? wide_ : dtype_, "decode " + s.what);
    mean_ = norm.mean;
    rstd_ = norm.rstd;
    qkv_ = A({T, qkv_width()}, "decode qkv");
    if (layers_.spec.qk_norm) qk_rstd_ = a.alloc({T, dims_.n_head + dims_.kv_heads()}, wide_, "decode q/k rstd");
    att_ = A({T, dims_.n_head * head_dim()}, "decode attention output");
    rope_ready_ = false;
    if (layers_.spec.rotary) {
      cos_ = a.alloc({T, head_dim() / 2}, wide_, "decode rotary cos");
      sin_ = a.alloc({T, head_dim() / 2}, wide_, "decode rotary sin");
    }
    k_.clear();
    v_.clear();
    for (size_t l = 0; l < layers_.blocks.size(); ++l) {
      k_.push_back(A({1, T, KVD}, "key cache"));
      v_.push_back(A({1, T, KVD}, "value cache"));
    }
  }

  void run(const KernelContext& ctx, const Tensor& tokens, int64_t n, int64_t pos, Tensor logits) override {
    if (layers_.spec.rotary && !rope_ready_) {
      rope_table(ctx, cos_, sin_, dims_.rope);
      rope_ready_ = true;
    }
    const int H = dims_.n_head, KV = dims_.kv_heads();
    TpComm tp(TensorParallel{}, n);  // a group of one: the layers' one-rank paths
    auto rows = [n](const Tensor& t) { return t.defined() ? t.slice(0, n) : Tensor(); };
    Tensor x = rows(x_), y = rows(y_), ln = rows(ln_), mean = rows(mean_), rstd = rows(rstd_), qkv = rows(qkv_),
           att = rows(att_);
    FfnActs ffn{rows(ffn_.pre), rows(ffn_.post)};
    Tensor qkv3 = qkv.view({1, n, qkv_width()});
    layers_.embed->forward(ctx, tp, x, tokens.view({1, n}));
    if (layers_.positions)  // row i at position pos + i
      layers_.positions->forward(ctx, x, ContextSplit::whole(max_len()), 0, pos);
    for (size_t l = 0; l < layers_.blocks.size(); ++l) {
      const DecoderLayers::Block& b = layers_.blocks[l];
      b.norm1.forward(ctx, ln, mean, rstd, x);
      b.attn.qkv_proj().forward(ctx, qkv, ln);
      if (b.attn.qk_norm()) b.attn.normalize_qk(ctx, qkv3, rows(qk_rstd_).view({1, n, qk_rstd_.size(1)}), qkv3);
      if (layers_.spec.rotary) rope_qkv_forward(ctx, qkv3, cos_, sin_, H, KV, n, pos);  // row i at position pos + i
      decode_attention_forward(ctx, att.view({1, n, att.size(1)}), k_[l], v_[l], qkv3, pos, H, KV);
      b.attn.proj().forward_unsplit(ctx, y, att);
      b.norm2.residual_forward(ctx, y, ln, mean, rstd, y, x);  // y = attention + x; ln = norm(y)
      b.ffn->forward(ctx, tp, x, ffn, ln, y);                   // x = y + ffn(ln)
    }
    const int64_t r = logits.size(0);
    Tensor lnf = ln.slice(n - r, n);
    layers_.final_norm->forward(ctx, lnf, mean.defined() ? mean.slice(0, r) : Tensor(), rstd.slice(0, r),
                                x.slice(n - r, n));
    linear_forward(ctx, logits, lnf, layers_.head_table().value, Tensor());
  }

  DecoderLayers layers_;
  Tensor x_, y_, ln_, mean_, rstd_;  // (T, C) x 3, (T) (LayerNorm only), (T)
  Tensor qkv_, att_;                 // (T, (H + 2 KV) D), (T, H D)
  Tensor qk_rstd_;                   // (T, H + KV) with a q/k norm
  FfnActs ffn_;                      // (T, .) the feed-forward's hidden activations
  Tensor cos_, sin_;                 // (T, D/2) rotary tables for every position
  bool rope_ready_ = false;
  std::vector<Tensor> k_, v_;        // per layer (1, T, KV D), keys rotated
};

}  // namespace

std::unique_ptr<Decoder> make_spec_decoder(const DecoderSpec& spec, ModelChunk& chunk, Device device,
                                           int logits_rows) {
  if (spec.ffn == FfnKind::Moe)
    fail(ErrorKind::Usage, spec.name, ": generation with a mixture-of-experts feed-forward is not built yet");
  return std::make_unique<SpecDecoder>(spec, chunk, device, logits_rows);
}

}  // namespace xirang
