// models/gpt2/gpt2.h: the GPT-2 model with hand-written forward and backward,
// tensor parallelism and sequence parallelism.
//
// Architecture: learned position embeddings; pre-LayerNorm blocks with a
// fused QKV projection, causal multi-head attention and a 4x MLP with GELU
// (tanh form); a final LayerNorm; an LM head tied to the token embedding; the
// vocabulary padded to a multiple of 128 (padding logits take no part in the
// softmax). Parameter names follow Hugging Face's GPT2Model ("h.0.attn.c_attn.weight").
//
// A GPT2 object holds one pipeline stage: a contiguous range of blocks, plus
// the embedding on the first stage and the final LayerNorm, head and loss on
// the last (a single rank holds everything). Memory is carved from arenas
// the runtime sizes and owns.
//
// Tensor parallelism over a group of P ranks (Megatron's split): the QKV and
// MLP up-projections are column-parallel (each rank holds H/P heads and 4C/P
// hidden units; input identity forward, all-reduce backward), the attention
// and MLP output projections row-parallel (all-reduce forward, identity
// backward), the token table and the logits vocabulary-parallel (Vp/P rows
// each; the softmax's max and sum are reduced across the group, so no rank
// holds the full logits). With sequence parallelism the residual stream and
// the LayerNorms between those regions hold N/P of the N = B*T token rows
// each: all-gather replaces the identity, reduce-scatter the all-reduce, and
// the LayerNorm gradients (partial sums over each rank's rows) are
// all-reduced across the group once per step.
//
//   ModelDims dims = {.arch = "gpt2", .n_layer = 12, .n_head = 12, .d_model = 768};
//   GPT2 model(dims, ChunkPlacement::whole(dims.n_layer), DType::F32, {.micro_batch = 4, .seq_len = 256},
//              {.group = &grid.tp(), .sequence_parallel = true});
//   model.layout_parameters(param_arena, grad_arena);   // then as any ModelChunk (models/model.h)
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "models/model.h"

namespace xirang {

// The registry entry of model.arch=gpt2 (models/model.cc lists it).
ModelArch gpt2_arch();

// The parameters of a GPT-2 chunk held by tensor-parallel rank tp_rank of
// tp, in layout order, without storage (value and grad are null views of
// the local shapes in dtype and grad_dtype).
std::vector<Parameter> gpt2_parameters(const ModelDims& dims, const ChunkPlacement& placement, int tp, int tp_rank,
                                       DType dtype = DType::F32, DType grad_dtype = DType::F32);

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
  // 6 x matrix parameters + 12 L C T for attention.
  double flops_per_token() const override;
  double take_tp_comm_ms() override;
  int tp_size() const { return tp_size_; }

 private:
  struct BlockParams {
    Parameter *ln1_w, *ln1_b;    // (C)
    Parameter *qkv_w, *qkv_b;    // (3C/P, C), (3C/P)   column-parallel
    Parameter *attn_w, *attn_b;  // (C, C/P), (C)       row-parallel
    Parameter *ln2_w, *ln2_b;    // (C)
    Parameter *fc_w, *fc_b;      // (4C/P, C), (4C/P)   column-parallel
    Parameter *proj_w, *proj_b;  // (C, 4C/P), (C)      row-parallel
  };
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

  void block_forward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a);
  void block_backward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a, GradPhase phase);
  // LayerNorm of the R local rows into `out` (R, C); returns the (N, C)
  // input of the column-parallel region that follows (gathered(out)).
  Tensor norm_to_full(const KernelContext& ctx, Tensor out, Tensor mean, Tensor rstd, const Tensor& x,
                      const Parameter& w, const Parameter& b);
  // Local rows (R, C) as all N rows: under sequence parallelism all-gathered
  // into ln_full_ (valid until the next call), else `local` itself. Slots
  // keep only their local LayerNorm outputs; the backward gathers again for
  // the weight gradient, as Megatron does, trading one all-gather for
  // (N - R) C values per LayerNorm per slot.
  Tensor gathered(const Tensor& local);
  // A row-parallel product's partial sums (N, C) reduced into the R local rows of `out`.
  void reduce_rows(Tensor partial, Tensor out);
  // The gradient of R local rows as the (N, C) gradient a row-parallel region needs.
  Tensor full_rows(Tensor local);
  void head_loss(const KernelContext& ctx, SlotActs& s, const Tensor& targets, double dloss);
  void tp_all_reduce(Tensor t, ReduceOp op);
  void reduce_partial_norm_grads(const Parameter& w, const Parameter& b);

  TensorParallel par_;
  int tp_size_ = 1, tp_rank_ = 0;
  int64_t rows_ = 0, local_rows_ = 0;  // N and R
  Parameter *wte_ = nullptr, *wpe_ = nullptr;      // (Vp/P, C), (max_seq_len, C)
  Parameter *lnf_w_ = nullptr, *lnf_b_ = nullptr;  // (C)
  std::vector<BlockParams> blocks_;
  std::vector<SlotActs> slots_;
  Tensor partial_;  // (N, C) row-parallel outputs and column-parallel input gradients before reduction
  Tensor ln_full_;  // (N, C) a LayerNorm output gathered over tp (sequence parallel), for one product
  Tensor d_res_;    // (R, C) gradient of the residual stream
  Tensor d_full_;   // (N, C) gathered residual gradient (sequence parallel)
  Tensor d_c_;      // (R, C) reduced gradient of a LayerNorm output
  Tensor d_big_;    // (N, 4C/P) MLP hidden gradient; also attention output and qkv gradients
  Tensor ce_max_, ce_sums_;  // (N), (N, 2) vocabulary-parallel softmax statistics
  Tensor loss_sum_;  // (1) F64: the mean losses of the forwards since take_loss()
  bool loss_pending_ = false;  // loss_sum_ holds a sum (else it is reset at the next forward)
  double tp_comm_ms_ = 0;  // host time in tensor-parallel calls (on a device: launch and join only)
  void* stream_ = nullptr;  // the compute stream of the pass in progress (tensor-parallel joins)
};

}  // namespace xirang
