// models/gpt2.h: the GPT-2 model with hand-written forward and backward,
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
//   GPT2 model(shape, GPT2Stage::whole(shape), DType::F32, {.micro_batch = 4, .seq_len = 256},
//              {.tp = &grid.tp(), .sequence_parallel = true});
//   model.layout_parameters(param_arena, grad_arena);
//   model.layout_activations(act_arena);
//   model.init_parameters(seed);
//   model.forward(ctx, slot, tokens, targets, dloss);  // dloss > 0: training
//   double loss = model.take_loss(ctx);                // the mean loss, read back once
//   model.backward(ctx, slot, tokens, GradPhase::Final);
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/arena.h"
#include "kernels/context.h"

namespace xirang {

struct GPT2Shape {
  int n_layer = 12;
  int n_head = 12;
  int d_model = 768;
  int max_seq_len = 1024;  // rows of the position table
  int vocab_size = 50257;
  int padded_vocab = 50304;
};

// The part of the model one pipeline stage holds.
struct GPT2Stage {
  int first_layer = 0;
  int end_layer = 0;  // exclusive
  bool has_embedding = true;
  bool has_head = true;
  static GPT2Stage whole(const GPT2Shape& s) { return {0, s.n_layer, true, true}; }
};

struct GPT2Batch {
  int micro_batch = 1;       // sequences per microbatch (B)
  int seq_len = 64;          // tokens per sequence (T)
  int activation_slots = 1;  // microbatches whose activations are alive at once
};

struct GPT2Parallel {
  Communicator* tp = nullptr;      // the tensor-parallel group; null means a group of one
  bool sequence_parallel = false;  // split the token rows between the parallel regions
};

// How a parameter's local tensor maps onto the single-rank tensor: `dim` is
// split over `parts` ranks (-1: replicated), this rank holding part `index`;
// the split dimension is made of `blocks` equal blocks each split the same
// way (3 for the fused QKV: q, k and v rows each split by heads).
struct ShardSpec {
  Shape global;
  int dim = -1;
  int parts = 1;
  int index = 0;
  int blocks = 1;
  bool replicated() const { return dim < 0 || parts == 1; }
  // Global flat index of local flat element i of a tensor of shape `local`.
  int64_t global_index(const Shape& local, int64_t i) const;
};

struct Parameter {
  std::string name;  // "h.3.mlp.c_fc.weight"
  Tensor value;      // this rank's part; shape comment at the definition site
  Tensor grad;       // same shape, accumulated over microbatches
  bool decay;        // weight decay applies (matrices and embeddings, not biases or norms)
  int layer;         // block index; -1 embeddings, n_layer for the final norm
  ShardSpec shard;   // where `value` sits in the single-rank tensor
  bool tied_copy = false;  // the last pipeline stage's copy of the tied token table (counted once in norms)
};

// Whether this backward pass makes the gradients final for the step: the
// last microbatch's does (gradient-ready hooks fire, sequence-parallel
// LayerNorm gradients are reduced across the tensor-parallel group).
enum class GradPhase { Accumulate, Final };

class GPT2 {
 public:
  GPT2(const GPT2Shape& shape, const GPT2Stage& stage, DType dtype, const GPT2Batch& batch,
       const GPT2Parallel& parallel = {});

  // Carves parameters and gradients (same order, so the flat buffers align:
  // under a 16-bit dtype each allocation is padded to a whole number of
  // 256-byte blocks of the narrower type, so element offsets agree).
  void layout_parameters(Arena& params, Arena& grads);
  // Carves activations for every slot plus backward scratch.
  void layout_activations(Arena& acts);
  // Each element = f(seed, parameter name, global element index), rounded to dtype().
  void init_parameters(uint64_t seed);

  // Forward of one microbatch (tokens, targets: (B, T) int32) into activation
  // slot `slot`. On the stage with the head, the mean loss over its tokens
  // is added to the loss sum, which stays on the model's device (no wait).
  // With dloss > 0 the loss gradient (dloss per token) is prepared for backward().
  void forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets, double dloss);
  // The sum of the mean losses of the forwards since the last call (0 on a
  // stage without the head), read back to the host, and the sum reset. On a
  // device this waits for the forwards queued so far: once per step.
  double take_loss(const KernelContext& ctx);
  // Backward of the microbatch in `slot`; parameter gradients accumulate.
  // A stage without the head takes the gradient of its output, (R, C), from
  // the next stage; afterwards input_grad() holds the gradient of its input.
  void backward(const KernelContext& ctx, int slot, const Tensor& tokens, GradPhase phase = GradPhase::Final,
                const Tensor& output_grad = Tensor());
  // Pipeline stage boundaries: the (R, C) activation a stage without the
  // embedding reads (fill it before forward), the (R, C) activation it
  // hands to the next stage (valid until the slot's backward), and the
  // gradient of its input after backward (valid until the next backward).
  Tensor stage_input(int slot) { return slots_.at(size_t(slot)).input; }
  Tensor stage_output(int slot);
  Tensor input_grad() { return d_res_; }
  const GPT2Batch& batch() const { return batch_; }
  // Called during a Final backward each time a layer's parameter gradients
  // are complete: n_layer after the head (final norm), l after block l, -1
  // after the embeddings (the tied token table gets its last contribution
  // there). The data-parallel gradient reduction starts from it.
  void set_grad_ready_hook(std::function<void(int layer)> hook) { grad_ready_ = std::move(hook); }

  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  int64_t num_parameters() const;         // this rank's
  int64_t num_global_parameters() const;  // the whole stage's, over all tensor-parallel ranks
  // Training FLOPs per token of the whole model (forward + backward):
  // 6 x matrix parameters + 12 L C T for attention.
  double flops_per_token() const;
  // Milliseconds spent in tensor-parallel communication since the last call.
  double take_tp_comm_ms();
  const GPT2Shape& shape() const { return shape_; }
  const GPT2Stage& stage() const { return stage_; }
  // Parameters and activations (F32, F64, BF16 or F16).
  DType dtype() const { return dtype_; }
  // Parameter gradients, and the statistics kept for backward: F32 under a
  // 16-bit dtype (kernels/context.h), else dtype().
  DType grad_dtype() const { return wide_dtype_; }
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

  Parameter* add_param(const std::string& name, Shape local, ShardSpec shard, bool decay, int layer);
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

  GPT2Shape shape_;
  GPT2Stage stage_;
  DType dtype_;
  DType wide_dtype_;  // gradients and saved statistics
  GPT2Batch batch_;
  GPT2Parallel par_;
  int tp_size_ = 1, tp_rank_ = 0;
  int64_t rows_ = 0, local_rows_ = 0;  // N and R
  std::vector<Parameter> params_;
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
  std::function<void(int)> grad_ready_;
  Tensor loss_sum_;  // (1) F64: the mean losses of the forwards since take_loss()
  bool loss_pending_ = false;  // loss_sum_ holds a sum (else it is reset at the next forward)
  double tp_comm_ms_ = 0;  // host time in tensor-parallel calls (on a device: launch and join only)
  void* stream_ = nullptr;  // the compute stream of the pass in progress (tensor-parallel joins)
};

}  // namespace xirang
