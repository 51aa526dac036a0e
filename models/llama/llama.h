// models/llama/llama.h: the LLaMA family (Llama 2, Llama 3) as a
// composition of the tensor-parallel layers of models/layers/.
//
// Architecture: no position table; pre-RMSNorm blocks (norm_eps) with a
// fused, bias-free q/k/v projection whose q and k heads are rotated (RoPE,
// rope_theta and Llama 3.1 frequency scaling: kernels/rope.h), causal
// grouped-query attention (n_kv_head key/value heads shared by n_head query
// heads), a bias-free output projection, and a SwiGLU MLP of width
// ffn_hidden (packed [gate; up] projection, down projection); a final
// RMSNorm; an LM head that is its own table (lm_head) unless
// tie_embeddings. Every weight is drawn N(0, 0.02), norms start at 1, as
// transformers' LlamaPreTrainedModel does.
//
// Parameter names follow Hugging Face's LlamaModel with q/k/v and gate/up
// fused: embed_tokens.weight, layers.{i}.input_layernorm.weight,
// layers.{i}.self_attn.qkv_proj.weight ([q; k; v] rows: n_head D, then
// n_kv_head D twice), layers.{i}.self_attn.o_proj.weight,
// layers.{i}.post_attention_layernorm.weight,
// layers.{i}.mlp.gate_up_proj.weight ([gate; up] rows, F each),
// layers.{i}.mlp.down_proj.weight, norm.weight, lm_head.weight.
//
// Tensor parallelism: qkv_proj column-parallel in three unequal blocks (q,
// k, v: each split by heads, so tp divides n_head and n_kv_head),
// gate_up_proj column-parallel in two blocks (a rank holds [Wg_r; Wu_r]),
// o_proj and down_proj row-parallel, the token table and lm_head split by
// vocabulary rows, the RMSNorm regions split by token rows under sequence
// parallelism. Pipeline chunks as GPT-2's (models/gpt2/gpt2.h).
//
//   ModelDims dims = {.arch = "llama", .n_layer = 32, .n_head = 32, .n_kv_head = 8, .d_model = 4096, ...};
//   Llama model(dims, ChunkPlacement::whole(dims.n_layer), DType::BF16, {.micro_batch = 1, .seq_len = 8192});
#pragma once

#include <optional>
#include <vector>

#include "models/layers/attention.h"
#include "models/layers/embedding.h"
#include "models/layers/loss.h"
#include "models/layers/mlp.h"
#include "models/layers/norm.h"
#include "models/model.h"

namespace xirang {

// The registry entry of model.arch=llama (models/model.cc lists it).
ModelArch llama_arch();

// Meta's MLP width: hidden = int(2 (4 d_model) / 3), times ffn_dim_multiplier
// when > 0 (truncated), rounded up to a multiple of multiple_of. 14336 for
// Llama 3 8B (4096, 1.3, 1024), 11008 for Llama 2 7B (4096, none, 256).
int llama_ffn_hidden(int d_model, int multiple_of, double ffn_dim_multiplier);
// dims.ffn_hidden, or the rule above from dims' multiple_of and multiplier.
int llama_ffn_hidden(const ModelDims& dims);
// The layout's rules: heads, key/value heads and vocabulary rows over tp, an even head size.
std::string llama_layout_problem(const ModelDims& dims, const ParallelLayout& layout);

std::vector<Parameter> llama_parameters(const ModelDims& dims, const ChunkPlacement& placement, int tp, int tp_rank,
                                        DType dtype = DType::F32, DType grad_dtype = DType::F32);

// The layers of a LLaMA chunk in layout order: embed_tokens, each block's, norm, lm_head.
struct LlamaLayers {
  struct Block {
    Norm input_norm;           // layers.l.input_layernorm
    CausalSelfAttention attn;  // layers.l.self_attn.qkv_proj (column), o_proj (row)
    Norm post_norm;            // layers.l.post_attention_layernorm
    GatedMlp mlp;              // layers.l.mlp.gate_up_proj (column), down_proj (row)
  };
  LlamaLayers(const ModelDims& dims, const ChunkPlacement& placement, int tp);
  void declare(ParamList& list);
  void bind(std::vector<Parameter>& params);
  bool tied() const { return dims.tie_embeddings.value_or(false); }
  // The table the head multiplies with: lm_head, or the tied token table.
  Parameter& head_table() const { return lm_head ? lm_head->table() : embed->table(); }

  ModelDims dims;
  ChunkPlacement placement;
  int ffn_hidden;
  std::optional<VocabParallelEmbedding> embed;    // first chunk; the last one's copy when tied
  std::vector<Block> blocks;                      // this chunk's
  std::optional<Norm> norm;                       // last chunk
  std::optional<VocabParallelEmbedding> lm_head;  // last chunk, untied
  std::optional<VocabParallelLoss> head;          // last chunk
};

class Llama final : public ModelChunk {
 public:
  Llama(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch,
        const TensorParallel& parallel = {});

  void layout_activations(Arena& acts) override;
  void forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets,
               double dloss) override;
  double take_loss(const KernelContext& ctx) override;
  void backward(const KernelContext& ctx, int slot, const Tensor& tokens, GradPhase phase = GradPhase::Final,
                const Tensor& output_grad = Tensor(), BackwardPart part = BackwardPart::Full) override;
  Tensor stage_input(int slot) override { return slots_.at(size_t(slot)).input; }
  Tensor stage_output(int slot) override;
  Tensor input_grad() override { return d_res_; }
  // (B*T, Vp/P): the logits of the last forward in `slot` with dloss 0 (tests compare generation with them).
  Tensor logits(int slot) const { return slots_.at(size_t(slot)).logits; }
  // 6 x matrix parameters (q, k, v, o, gate, up, down, head) + 12 L C T for attention.
  double flops_per_token() const override;
  TpCommTime take_tp_comm() override { return tp_.take(); }

 private:
  struct BlockActs {
    Tensor ln1, ln1_rstd;  // (R, C), (R)
    Tensor qkv;            // (B, T, (H + 2 KV) D / P), q and k rotated
    Tensor lse;            // (B, H/P, T)
    Tensor atty;           // (B, T, C/P)
    Tensor res2;           // (R, C) residual after attention
    Tensor ln2, ln2_rstd;  // (R, C), (R)
    Tensor gu, h;          // (N, 2F/P) [gate | up], (N, F/P) silu(gate) * up
    Tensor res3;           // (R, C) block output
  };
  struct SlotActs {
    Tensor input;                   // (R, C)
    std::vector<BlockActs> blocks;  // one per local layer
    Tensor lnf, lnf_rstd;           // (R, C), (R)
    Tensor logits;                  // (N, Vp/P); dlogits after a training forward
    Tensor losses;                  // (N)
  };

  void layout_slot(Arena& acts, SlotActs& s);
  void ensure_rope(const KernelContext& ctx);
  // Layer l's activations of slot s as the block passes see them: the
  // slot's own, with what the recompute mode drops taken from work_.
  BlockActs block_acts(SlotActs& s, size_t l) const;
  // Before layer l's backward: recomputes what the mode dropped (a "recompute" span).
  void recompute(const KernelContext& ctx, const LlamaLayers::Block& b, const Tensor& x, BlockActs& a);
  // whole = false stops before the MLP's down projection (full recomputation needs no block output).
  void block_forward(const KernelContext& ctx, const LlamaLayers::Block& b, const Tensor& x, BlockActs& a,
                     bool whole = true);
  void block_backward(const KernelContext& ctx, const LlamaLayers::Block& b, const Tensor& x, BlockActs& a,
                      GradPhase phase);
  void head_forward(const KernelContext& ctx, SlotActs& s, const Tensor& x, const Tensor& targets, double dloss);
  void head_backward(const KernelContext& ctx, SlotActs& s, GradPhase phase);

  TpComm tp_;
  LlamaLayers layers_;
  std::vector<SlotActs> slots_;
  // Selective: the attention output and log-sum-exp and the SwiGLU output
  // of the layer being differentiated; full: all of a block's activations
  // but its output. Shared by every slot and layer.
  BlockActs work_;
  RotaryTables rope_;         // (T, D/2) cos and sin, filled at the first forward
  bool rope_ready_ = false;
  Tensor d_res_;    // (R, C)
  Tensor d_c_;      // (R, C)
  Tensor d_big_;    // backward scratch: MLP (N, 3F/P) or attention (N, C/P + qkv width)
  Tensor loss_sum_;
  bool loss_pending_ = false;
};

}  // namespace xirang
