// models/gpt2.h: the GPT-2 model with hand-written forward and backward.
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
// the runtime sizes and owns:
//
//   GPT2 model(shape, GPT2Stage::whole(shape), DType::F32, {.micro_batch = 4, .seq_len = 256});
//   model.layout_parameters(param_arena, grad_arena);
//   model.layout_activations(act_arena);
//   model.init_parameters(seed);
//   double loss = model.forward(ctx, slot, tokens, targets, dloss);  // dloss > 0: training
//   model.backward(ctx, slot, tokens);
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
  int micro_batch = 1;  // sequences per microbatch (B)
  int seq_len = 64;     // tokens per sequence (T)
  int activation_slots = 1;  // microbatches whose activations are alive at once
};

struct Parameter {
  std::string name;  // "h.3.mlp.c_fc.weight"
  Tensor value;      // this rank's part; shape comment at the definition site
  Tensor grad;       // same shape, accumulated over microbatches
  bool decay;        // weight decay applies (matrices and embeddings, not biases or norms)
  int layer;         // block index; -1 embeddings, n_layer for the final norm
};

class GPT2 {
 public:
  GPT2(const GPT2Shape& shape, const GPT2Stage& stage, DType dtype, const GPT2Batch& batch);

  // Carves parameters and gradients (same order, so the flat buffers align).
  void layout_parameters(Arena& params, Arena& grads);
  // Carves activations for every slot plus backward scratch.
  void layout_activations(Arena& acts);
  // Each element = f(seed, parameter name, global element index).
  void init_parameters(uint64_t seed);

  // Forward of one microbatch (tokens, targets: (B, T) int32) into activation
  // slot `slot`. Returns the mean loss over its tokens. With dloss > 0 the
  // loss gradient (dloss per token) is prepared for backward().
  double forward(const KernelContext& ctx, int slot, const Tensor& tokens, const Tensor& targets, double dloss);
  // Backward of the microbatch in `slot`; parameter gradients accumulate.
  void backward(const KernelContext& ctx, int slot, const Tensor& tokens);
  // Called during backward() each time a layer's parameter gradients are
  // complete for this microbatch: n_layer after the head (final norm), l after
  // block l, -1 after the embeddings (the tied token table gets its last
  // contribution there). The data-parallel gradient reduction starts from it.
  void set_grad_ready_hook(std::function<void(int layer)> hook) { grad_ready_ = std::move(hook); }

  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  int64_t num_parameters() const;
  // Training FLOPs per token (forward + backward): 6 x matrix parameters + 12 L C T for attention.
  double flops_per_token() const;
  const GPT2Shape& shape() const { return shape_; }
  const GPT2Stage& stage() const { return stage_; }
  DType dtype() const { return dtype_; }

 private:
  struct BlockParams {
    Parameter *ln1_w, *ln1_b;    // (C)
    Parameter *qkv_w, *qkv_b;    // (3C, C), (3C)
    Parameter *attn_w, *attn_b;  // (C, C), (C)
    Parameter *ln2_w, *ln2_b;    // (C)
    Parameter *fc_w, *fc_b;      // (4C, C), (4C)
    Parameter *proj_w, *proj_b;  // (C, 4C), (C)
  };
  struct BlockActs {
    Tensor ln1, ln1_mean, ln1_rstd;  // (B, T, C), (B, T), (B, T)
    Tensor qkv;                      // (B, T, 3C)
    Tensor probs;                    // (B, H, T, T)
    Tensor atty;                     // (B, T, C) attention output before projection
    Tensor res2;                     // (B, T, C) residual after attention
    Tensor ln2, ln2_mean, ln2_rstd;  // (B, T, C), (B, T), (B, T)
    Tensor fch, fch_gelu;            // (B, T, 4C)
    Tensor res3;                     // (B, T, C) block output
  };
  struct SlotActs {
    Tensor input;                    // (B, T, C) embedding output or the previous stage's activation
    std::vector<BlockActs> blocks;   // one per local layer
    Tensor lnf, lnf_mean, lnf_rstd;  // (B, T, C), (B, T), (B, T)
    Tensor logits;                   // (B, T, Vp); holds dlogits after a training forward
    Tensor losses;                   // (B, T)
  };

  Parameter* add_param(const std::string& name, Shape shape, bool decay, int layer);
  void block_forward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a);
  void block_backward(const KernelContext& ctx, int l, const Tensor& x, BlockActs& a, Tensor dres);

  GPT2Shape shape_;
  GPT2Stage stage_;
  DType dtype_;
  GPT2Batch batch_;
  std::vector<Parameter> params_;
  Parameter *wte_ = nullptr, *wpe_ = nullptr;  // (Vp, C), (max_seq_len, C)
  Parameter *lnf_w_ = nullptr, *lnf_b_ = nullptr;  // (C)
  std::vector<BlockParams> blocks_;
  std::vector<SlotActs> slots_;
  Tensor d_res_;  // (B, T, C) gradient of the residual stream
  Tensor d_c_;    // (B, T, C) scratch
  Tensor d_big_;  // (B, T, 4C) scratch (also holds dqkv)
  std::function<void(int)> grad_ready_;
};

}  // namespace xirang
