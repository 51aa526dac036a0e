// models/gpt2/gpt2.h: GPT-2 as a composition of the tensor-parallel layers
// of models/layers/.
//
// Architecture: learned position embeddings; pre-LayerNorm blocks with a
// fused QKV projection, causal multi-head attention and a 4x MLP with GELU
// (tanh form); a final LayerNorm; an LM head tied to the token embedding; the
// vocabulary padded to a multiple of model.vocab_multiple (padding logits
// take no part in the softmax). Parameter names follow Hugging Face's
// GPT2Model ("h.0.attn.c_attn.weight").
//
// A GPT2 object is one pipeline chunk: a contiguous range of blocks, plus
// the embedding on the first chunk and the final LayerNorm, head and loss on
// the last (a single rank holds everything). The last chunk holds a copy of
// the token table for the head (tied_copy); the runtime sums the two
// copies' gradients. Tensor and sequence parallelism are the layers'
// (models/layers/linear.h, tp_comm.h): GPT-2 only decides where the
// residual stream's adds and norms go, and on one rank fuses the attention
// output's bias into its product and the residual add into the LayerNorm
// that follows.
//
//   ModelDims dims = {.arch = "gpt2", .n_layer = 12, .n_head = 12, .d_model = 768};
//   GPT2 model(dims, ChunkPlacement::whole(dims.n_layer), DType::F32, {.micro_batch = 4, .seq_len = 256},
//              {.group = &grid.tp(), .sequence_parallel = true});
//   model.layout_parameters(param_arena, grad_arena);   // then as any ModelChunk (models/model.h)
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

// The registry entry of model.arch=gpt2 (models/model.cc lists it).
ModelArch gpt2_arch();

// The parameters of a GPT-2 chunk held by tensor-parallel rank tp_rank of
// tp, in layout order, without storage (value and grad are null views of
// the local shapes in dtype and grad_dtype).
std::vector<Parameter> gpt2_parameters(const ModelDims& dims, const ChunkPlacement& placement, int tp, int tp_rank,
                                       DType dtype = DType::F32, DType grad_dtype = DType::F32);

// The layers of a GPT-2 chunk; declare() lists their parameters in layout
// order: wte, wpe, each block's, ln_f.
struct GPT2Layers {
  struct Block {
    Norm ln1;                  // h.l.ln_1
    CausalSelfAttention attn;  // h.l.attn.c_attn (column), h.l.attn.c_proj (row)
    Norm ln2;                  // h.l.ln_2
    Mlp mlp;                   // h.l.mlp.c_fc (column), h.l.mlp.c_proj (row)
  };
  GPT2Layers(const ModelDims& dims, const ChunkPlacement& placement, int tp);
  void declare(ParamList& list);
  void bind(std::vector<Parameter>& params);

  ModelDims dims;
  ChunkPlacement placement;
  std::optional<VocabParallelEmbedding> wte;  // first chunk (input), last chunk (the head's copy)
  std::optional<LearnedPositions> wpe;        // first chunk
  std::vector<Block> blocks;                  // this chunk's
  std::optional<Norm> ln_f;                   // last chunk
  std::optional<VocabParallelLoss> head;      // last chunk
};

class GPT2 final : public ModelChunk {
 public:
  GPT2(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch,
       const TensorParallel& parallel = {});

  void layout_activations(Arena& acts) override;
  void forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets,
               double dloss) override;
  double take_loss(const KernelContext& ctx) override;
  // A chunk without the head takes the (R, C) gradient of its output.
  void backward(const KernelContext& ctx, int slot, const Tensor& tokens, GradPhase phase = GradPhase::Final,
                const Tensor& output_grad = Tensor(), BackwardPart part = BackwardPart::Full) override;
  // (R, C) each: R = B*T token rows, or B*T/P with sequence parallelism.
  Tensor stage_input(int slot) override { return slots_.at(size_t(slot)).input; }
  Tensor stage_output(int slot) override;
  Tensor input_grad() override { return d_res_; }
  // (B*T, Vp/P): the logits of the last forward in `slot` with dloss 0 (tests compare generation with them).
  Tensor logits(int slot) const { return slots_.at(size_t(slot)).logits; }
  // 6 x matrix parameters + 12 L C T for attention.
  double flops_per_token() const override;
  TpCommTime take_tp_comm() override { return tp_.take(); }
  int tp_size() const { return tp_.size(); }

 private:
  // R = N / P token rows with sequence parallelism, else R = N = B * T.
  struct BlockActs {
    Tensor ln1, ln1_mean, ln1_rstd;  // (R, C) local rows (gathered when needed), (R), (R)
    Tensor qkv;                      // (B, T, 3C/P)
    Tensor lse;                      // (B, H/P, T) attention log-sum-exp (flash attention)
    Tensor atty;                     // (B, T, C/P) attention output before projection
    Tensor res2;                     // (R, C) residual after attention
    Tensor ln2, ln2_mean, ln2_rstd;  // (R, C), (R), (R)
    Tensor fch, fch_gelu;            // (N, 4C/P) before and after GELU
    Tensor res3;                     // (R, C) block output
  };
  struct SlotActs {
    Tensor input;                    // (R, C) embedding output or the previous stage's activation
    std::vector<BlockActs> blocks;   // one per local layer
    Tensor lnf, lnf_mean, lnf_rstd;  // (R, C), (R), (R)
    Tensor logits;                   // (N, Vp/P); holds dlogits after a training forward
    Tensor losses;                   // (N)
  };

  void layout_slot(Arena& acts, SlotActs& s);
  // Layer l's activations of slot s as the block passes see them: the
  // slot's own, with what the recompute mode drops taken from work_.
  BlockActs block_acts(SlotActs& s, size_t l) const;
  // Before layer l's backward: recomputes what the mode dropped (a "recompute" span).
  void recompute(const KernelContext& ctx, const GPT2Layers::Block& b, const Tensor& x, BlockActs& a);
  // whole = false stops before the MLP's down projection (full recomputation needs no block output).
  void block_forward(const KernelContext& ctx, const GPT2Layers::Block& b, const Tensor& x, BlockActs& a,
                     bool whole = true);
  void block_backward(const KernelContext& ctx, const GPT2Layers::Block& b, const Tensor& x, BlockActs& a,
                      GradPhase phase);
  void head_forward(const KernelContext& ctx, SlotActs& s, const Tensor& x, const Tensor& targets, double dloss);
  void head_backward(const KernelContext& ctx, SlotActs& s, GradPhase phase);

  TpComm tp_;  // before layers_: they are built for its size
  GPT2Layers layers_;
  std::vector<SlotActs> slots_;
  // Selective: the attention output and log-sum-exp (and in fp32 the GELU
  // output) of the layer being differentiated; full: all of a block's
  // activations but its output. Shared by every slot and layer.
  BlockActs work_;
  bool drop_gelu_ = false;  // selective recomputation recomputes the GELU output (fp32 storage)
  Tensor d_res_;    // (R, C) gradient of the residual stream
  Tensor d_c_;      // (R, C) reduced gradient of a LayerNorm output
  Tensor d_big_;    // (N, 4C/P) MLP hidden gradient; also attention output and qkv gradients
  Tensor loss_sum_;  // (1) F64: the mean losses of the forwards since take_loss()
  bool loss_pending_ = false;  // loss_sum_ holds a sum (else it is reset at the next forward)
};

}  // namespace xirang
