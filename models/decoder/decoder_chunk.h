// models/decoder/decoder_chunk.h: the one pipeline chunk of every decoder-only
// architecture, built from a DecoderSpec's choice per role.
//
// A block is pre-norm: norm 1, token mixer (causal self-attention), residual
// add, norm 2, feed-forward, residual add. The roles have one signature each
// (models/layers/), so the spec picks LayerNorm or RMSNorm, learned or
// rotary positions, a GELU MLP or SwiGLU, tied or untied head, and the
// parameter names and init rules; the chunk owns everything else: the
// activation layout (from the layers' activation lists), recomputation, the
// forward and backward loops, the head and loss, the pipeline boundaries
// and the gradient-ready calls, and the backward split into its input- and
// weight-gradient parts (BackwardPart) for the zero-bubble schedules. An
// architecture is then its spec (models/gpt2/gpt2.cc, models/llama/llama.cc,
// models/qwen3/qwen3.cc).
//
// A chunk is a contiguous range of blocks, plus the embedding on the first
// chunk and the final norm, head and loss on the last (one rank holds
// everything). A tied head on a last chunk without the embedding holds a
// copy of the token table (tied_copy); the runtime sums the copies'
// gradients. Tensor and sequence parallelism are the layers' (linear.h,
// tp_comm.h); on one rank the attention output's bias rides on its product
// and the residual add on the norm that follows.
//
//   DecoderSpec spec = gpt2_spec(dims);
//   DecoderChunk c(spec, dims, ChunkPlacement::whole(dims.n_layer), DType::F32,
//                  {.micro_batch = 4, .seq_len = 256}, {.group = &grid.tp()});
//   c.layout_parameters(param_arena, grad_arena);   // then as any ModelChunk (models/model.h)
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/layers/attention.h"
#include "models/layers/embedding.h"
#include "models/layers/loss.h"
#include "models/layers/mlp.h"
#include "models/layers/norm.h"
#include "models/layers/weight_grads.h"
#include "models/model.h"

namespace xirang {

// An architecture's choices for the decoder's roles, for one ModelDims.
struct DecoderSpec {
  std::string name;  // in error messages ("GPT2")
  NormKind norm = NormKind::LayerNorm;
  FfnKind ffn = FfnKind::Gelu;
  int ffn_hidden = 0;           // F
  int head_dim = 0;             // 0: dims.head_size() (model.head_dim, or d_model / n_head)
  bool bias = true;             // the attention and feed-forward projections carry biases
  bool rotary = false;          // rotate q and k (dims.rope); false: a learned position table
  bool qk_norm = false;         // RMS-normalize each q and k head before the rotation (norm_eps)
  bool grouped_query = true;    // n_kv_head < n_head allowed
  bool tied = true;             // the head multiplies the token table
  // Parameter names: "{block}{l}.{norm1}.weight" and so on.
  struct Names {
    std::string embed, positions;      // full names ("wte.weight")
    std::string block;                 // prefix of block l ("h.")
    std::string norm1, qkv, proj, norm2, up, down;
    std::string q_norm, k_norm;        // with qk_norm ("self_attn.q_norm")
    std::string final_norm, head;      // "ln_f" (a prefix), "lm_head.weight"
  } names;
  InitRule weight = InitRule::normal(0.02);    // embeddings, q/k/v and up-projections
  InitRule residual = InitRule::normal(0.02);  // projections into the residual stream
  // What sets ffn_hidden, in the layout rules' messages.
  std::string ffn_keys = "model.d_model";
  // Layout rules of the architecture's own beyond the decoder's
  // (decoder_layout_problem): "" or the rule `layout` breaks; null: none.
  std::string (*layout_problem)(const ModelDims&, const ParallelLayout&) = nullptr;
  // Its config keys' rules (ModelArch::key_rules); null: none beyond every model's.
  std::vector<KeyRule> (*key_rules)(const ModelDims&) = nullptr;
  int resolved_head_dim(const ModelDims& d) const { return head_dim > 0 ? head_dim : d.head_size(); }
};

// The rules every layout of a decoder must keep, then the spec's own: an
// even head for rotary embeddings; query heads, key/value heads, the
// feed-forward width and the padded vocabulary divisible by tp. "" or the
// rule `layout` breaks (ModelArch::layout_problem).
std::string decoder_layout_problem(const DecoderSpec& spec, const ModelDims& dims, const ParallelLayout& layout);

// The layers of a decoder chunk; declare() lists their parameters in
// layout order: embedding, positions, each block's, final norm, untied head.
struct DecoderLayers {
  struct Block {
    Norm norm1;
    CausalSelfAttention attn;  // qkv (column), proj (row)
    Norm norm2;
    std::unique_ptr<FeedForward> ffn;  // up (column), down (row)
  };
  DecoderLayers(const DecoderSpec& spec, const ModelDims& dims, const ChunkPlacement& placement, int tp);
  void declare(ParamList& list);
  void bind(std::vector<Parameter>& params);
  // The table the head multiplies with: the untied head, or the token table.
  Parameter& head_table() const { return lm_head ? lm_head->table() : embed->table(); }

  DecoderSpec spec;
  ModelDims dims;
  ChunkPlacement placement;
  std::optional<VocabParallelEmbedding> embed;    // first chunk; the last one's copy when tied
  std::optional<LearnedPositions> positions;      // first chunk, without rotary tables
  std::vector<Block> blocks;                      // this chunk's
  std::optional<Norm> final_norm;                 // last chunk
  std::optional<VocabParallelEmbedding> lm_head;  // last chunk, untied
  std::optional<VocabParallelLoss> head;          // last chunk
};

// The parameters of a chunk held by tensor-parallel rank tp_rank of tp, in
// layout order, without storage (null views of the local shapes).
std::vector<Parameter> decoder_parameters(const DecoderSpec& spec, const ModelDims& dims,
                                          const ChunkPlacement& placement, int tp, int tp_rank,
                                          DType dtype = DType::F32, DType grad_dtype = DType::F32);

class DecoderChunk : public ModelChunk {
 public:
  DecoderChunk(const DecoderSpec& spec, const ModelDims& dims, const ChunkPlacement& placement, DType dtype,
               const ChunkBatch& batch, const TensorParallel& parallel = {});

  void layout_activations(Arena& acts) override;
  void forward(const KernelContext& ctx, MicrobatchSlots slot, const Tensor& tokens, const Tensor& targets,
               double dloss) override;
  double take_loss(const KernelContext& ctx) override;
  // A chunk without the head takes the (R, C) gradient of its output.
  void backward(const KernelContext& ctx, MicrobatchSlots slot, const Tensor& tokens,
                GradPhase phase = GradPhase::Final, const Tensor& output_grad = Tensor(),
                BackwardPart part = BackwardPart::Full) override;
  // With ChunkBatch::split_backward: the weight products' layer inputs in
  // input slots, a WeightGradQueue per weight slot.
  bool splits_backward() const override { return batch_.split_backward; }
  // (R, C) each: R = B*T token rows, or B*T/P with sequence parallelism.
  Tensor stage_input(int slot) override { return slots_.at(size_t(slot)).input; }
  Tensor stage_output(int slot) override;
  Tensor input_grad() override { return d_res_; }
  // (B*T, Vp/P): the logits of the last forward in `slot` with dloss 0 (tests compare generation with them).
  Tensor logits(int slot) const { return slots_.at(size_t(slot)).logits; }
  // 6 x matrix parameters + 12 L T H head_dim for attention scores and values.
  double flops_per_token() const override;
  TpCommTime take_tp_comm() override { return tp_.take(); }
  // The MoE layers' balance loss and selection-bias update (models/layers/moe_ffn.h).
  double take_aux_loss() override;
  void end_step(const KernelContext& ctx) override;
  int tp_size() const { return tp_.size(); }
  const DecoderLayers& layers() const { return layers_; }

 private:
  // N = B * T token rows (T: this cp rank's share of a sequence, T / cp);
  // R = N / P token rows with sequence parallelism, else R = N.
  struct BlockActs {
    NormActs norm1;  // (R, C), (R), (R): local rows, gathered when needed
    AttnActs attn;   // qkv, log-sum-exp, output before the projection
    Tensor res2;     // (R, C) residual after attention
    NormActs norm2;  // (R, C), (R), (R)
    FfnActs ffn;     // (N, .) the feed-forward's hidden activations
    Tensor res3;     // (R, C) block output
  };
  struct SlotActs {
    Tensor input;                   // (R, C) embedding output or the previous stage's activation
    std::vector<BlockActs> blocks;  // one per local layer
    NormActs final_norm;            // (R, C), (R), (R)
    Tensor logits;                  // (N, Vp/P); holds dlogits after a training forward
    Tensor losses;                  // (N)
    const void* begin = nullptr;    // the slot's tensors lie in [begin, end)
    const void* end = nullptr;
  };

  DType act_dtype(const ActSpec& a) const { return a.dtype ? *a.dtype : a.wide ? wide_dtype_ : dtype_; }
  // Block l's activation list (shapes, and what recomputation keeps) over `a`.
  ActList block_activations(size_t l, BlockActs& a) const;
  // With a split backward, whether entry `e` of block_activations(l, a) is
  // a weight product's layer input kept in an input slot (forward to
  // weight part): the attention output and the feed-forward's activation,
  // and the norm outputs unless sequence parallelism gathers them (the
  // gathered rows are copied into the weight slot instead).
  bool in_input_slot(const ActSpec& e, const BlockActs& a) const;
  enum class Pool { Activation, Input };
  void layout_slot(Arena& acts, SlotActs& s, Pool pool);
  // Layer l's activations of a microbatch as the block passes see them:
  // its activation slot's, its input slot's (split backward), and what the
  // recompute mode drops taken from work_.
  BlockActs block_acts(const MicrobatchSlots& at, size_t l) const;
  // Before layer l's backward: recomputes what the mode dropped (a "recompute" span).
  void recompute(const KernelContext& ctx, size_t l, const Tensor& x, BlockActs& a);
  void ensure_rope(const KernelContext& ctx);
  const RotaryTables* rope() const { return layers_.spec.rotary ? &rope_ : nullptr; }
  // whole = false stops before the feed-forward's down projection (full recomputation needs no block output).
  void block_forward(const KernelContext& ctx, const DecoderLayers::Block& b, const Tensor& x, BlockActs& a,
                     bool whole = true);
  // On entry d_res_ holds d(block output) for the local rows; on exit
  // d(block input). `later`: the weight products are left to it.
  void block_backward(const KernelContext& ctx, const DecoderLayers::Block& b, const Tensor& x, BlockActs& a,
                      GradPhase phase, WeightGradQueue* later);
  void head_forward(const KernelContext& ctx, SlotActs& s, const Tensor& x, const Tensor& targets, double dloss);
  void head_backward(const KernelContext& ctx, SlotActs& s, GradPhase phase);
  void embedding_backward(const KernelContext& ctx, const Tensor& dy_full, const Tensor& tokens) const;
  // Bytes a weight slot's queue copies: each product's output gradient, and
  // each layer input that no input slot keeps (recomputed or gathered).
  int64_t weight_queue_bytes() const;

  CpComm cp_;  // context parallelism: this rank's share of each sequence, the key/value exchange
  TpComm tp_;  // after cp_ (its rows are the cp share's), before layers_ (they are built for its size)
  DecoderLayers layers_;
  std::vector<SlotActs> slots_;   // activation slots
  std::vector<SlotActs> inputs_;  // input slots (split backward): in_input_slot()'s entries only
  // What the recompute mode drops, for the layer being differentiated
  // (selective: the attention core and perhaps the feed-forward's
  // activation; full: all of a block but its output). Shared by every slot and layer.
  BlockActs work_;
  RotaryTables rope_;  // (T, D/2) cos and sin, filled at the first forward (rotary specs)
  bool rope_ready_ = false;
  Tensor d_res_;     // (R, C) gradient of the residual stream
  Tensor d_c_;       // (R, C) reduced gradient of a norm output
  Tensor d_big_;     // (N, .) backward scratch: the feed-forward's, or attention output and qkv gradients
  Tensor loss_sum_;  // (1) F64: the mean losses of the forwards since take_loss()
  std::vector<WeightGradQueue> later_;  // per weight slot, with split_backward
  std::vector<Tensor> later_storage_;   // each weight slot's bytes
  bool loss_pending_ = false;  // loss_sum_ holds a sum (else it is reset at the next forward)
};

// A chunk of one spec as a type, for code that builds chunks by type
// (tests: GPT2, Llama); the trainer builds them through the registry.
template <DecoderSpec (*Spec)(const ModelDims&)>
class SpecChunk final : public DecoderChunk {
 public:
  SpecChunk(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch,
            const TensorParallel& parallel = {})
      : DecoderChunk(Spec(dims), dims, placement, dtype, batch, parallel) {}
};

// The generation loop (models/decode.h) of a chunk built from `spec`: its
// blocks on the new rows only, keys and values cached (decoder_decode.cc).
std::unique_ptr<Decoder> make_spec_decoder(const DecoderSpec& spec, ModelChunk& chunk, Device device,
                                           int logits_rows);

// The model.moe.* rules of any decoder: none for a dense model; a refusal
// when the spec has no MoE feed-forward; the values' rules otherwise.
std::vector<KeyRule> moe_key_rules(const DecoderSpec& spec, const ModelDims& dims);

// A registry entry for an architecture that is a decoder spec: make_chunk
// parameters, layout_problem and make_decoder from spec(dims).
ModelArch decoder_arch(std::string name, DecoderSpec (*spec)(const ModelDims&), const ModelFileAdapter* files);

}  // namespace xirang
