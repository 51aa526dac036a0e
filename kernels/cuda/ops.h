// kernels/cuda/ops.h: the CUDA implementations of the kernel API.
//
// Each function has the signature, semantics and precision rules of the
// public op of the same name (kernels/*.h, kernels/context.h); the public op
// calls it when ctx.device is Device::CUDA. Tensors live in device memory;
// work is queued on ctx.cuda_stream and nothing here synchronizes the host,
// except the two reductions that return a host value (sum_squares,
// all_finite), which wait for their own result only.
//
// Built only when XIRANG_HAVE_CUDA is defined.
#pragma once

#include <vector>

#include "kernels/adamw.h"
#include "kernels/context.h"
#include "kernels/context_split.h"
#include "kernels/group_table.h"
#include "kernels/moe.h"
#include "kernels/rope.h"

namespace xirang::cuda {

// kernels/matmul.h (cuBLASLt; bias and GELU through epilogues)
void matmul(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
            double alpha, double beta);
void linear_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w, const Tensor& bias);
void linear_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, GradMode dx_mode);
void linear_gelu_forward(const KernelContext& ctx, Tensor y, Tensor pre, const Tensor& x, const Tensor& w,
                         const Tensor& bias);
void linear_gelu_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor dbias, Tensor dpre, const Tensor& dy,
                          const Tensor& pre, const Tensor& x, const Tensor& w, GradMode dx_mode);

// kernels/elementwise.h
void gelu_forward(const KernelContext& ctx, Tensor y, const Tensor& x);
void gelu_backward(const KernelContext& ctx, Tensor dx, const Tensor& dy, const Tensor& x);
void add_bias(const KernelContext& ctx, Tensor y, const Tensor& bias);
void add(const KernelContext& ctx, Tensor out, const Tensor& a, const Tensor& b);
void scale(const KernelContext& ctx, Tensor x, double s);
void zero(const KernelContext& ctx, Tensor x);
void cast(const KernelContext& ctx, Tensor out, const Tensor& in);
double sum_squares(const KernelContext& ctx, const Tensor& x);
bool all_finite(const KernelContext& ctx, const Tensor& x);
void sum_squares_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x);
void mean_accumulate(const KernelContext& ctx, Tensor acc, const Tensor& x);
void sum_squares_group(const KernelContext& ctx, Tensor out, const std::vector<Tensor>& xs, GroupTable& table);

// kernels/adamw.h (fused: master update and the 16-bit model copy in one pass)
void adamw_update(const KernelContext& ctx, Tensor param, const Tensor& grad, Tensor m, Tensor v,
                  const AdamWStep& s, Tensor model_copy);
void adamw_update_group(const KernelContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& s,
                        GroupTable& table);

// kernels/embedding.h
void embedding_lookup(const KernelContext& ctx, Tensor out, const Tensor& tokens, const Tensor& wte,
                      int64_t vocab_begin, int64_t vocab_size);
void embedding_lookup_backward(const KernelContext& ctx, Tensor dwte, const Tensor& dout, const Tensor& tokens,
                               int64_t vocab_begin, int64_t vocab_size);
void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, int64_t seq_len, int64_t row_offset);
void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, int64_t seq_len,
                            int64_t row_offset);
void add_positions(const KernelContext& ctx, Tensor x, const Tensor& wpe, const ContextSplit& split, int rank,
                   int64_t row_offset);
void add_positions_backward(const KernelContext& ctx, Tensor dwpe, const Tensor& dx, const ContextSplit& split,
                            int rank, int64_t row_offset);

// kernels/layernorm.h (the residual add fused into the forward)
void layernorm_forward(const KernelContext& ctx, Tensor y, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b);
void residual_layernorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor mean, Tensor rstd,
                                const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias);
void layernorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, Tensor db, const Tensor& dy, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, GradMode dx_mode);

// kernels/cross_entropy.h (softmax fused with the loss and its gradient)
void cross_entropy_forward_backward(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                    const Tensor& targets, int64_t vocab_size, double dloss);
void cross_entropy_shard_max(const KernelContext& ctx, Tensor row_max, const Tensor& logits, int64_t vocab_begin,
                             int64_t vocab_size);
void cross_entropy_shard_sums(const KernelContext& ctx, Tensor sums, const Tensor& logits, const Tensor& targets,
                              const Tensor& row_max, int64_t vocab_begin, int64_t vocab_size);
void cross_entropy_shard_finish(const KernelContext& ctx, Tensor losses, Tensor dlogits, const Tensor& logits,
                                const Tensor& targets, const Tensor& row_max, const Tensor& sums,
                                int64_t vocab_begin, int64_t vocab_size, double dloss);

// kernels/attention.h (causal flash attention: lse saved, probabilities
// recomputed; n_kv_head key/value heads, 0: n_head)
void flash_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                             int n_kv_head = 0);
void flash_attention_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, int n_head, int n_kv_head = 0);
// The two implementations the pair above chooses between by
// flash_attention_path: fp32 CUDA-core kernels for every storage dtype and
// head dim <= 128 (attention.cu, the reference), and tensor-core kernels for
// bf16 and f16 with head dim 32, 64, 96 or 128 (attention_tc.cu; P and dS
// rounded to the storage type before their products). Same contract.
void flash_attention_forward_fp32(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                                  int n_kv_head = 0);
void flash_attention_backward_fp32(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                                   const Tensor& out, const Tensor& lse, int n_head, int n_kv_head = 0);
void flash_attention_forward_tc(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, int n_head,
                                int n_kv_head = 0);
void flash_attention_backward_tc(const KernelContext& ctx, Tensor dqkv, const Tensor& dout, const Tensor& qkv,
                                 const Tensor& out, const Tensor& lse, int n_head, int n_kv_head = 0);

// kernels/cp_attention.h (fp32 CUDA cores; backward without atomics: dq per
// query row, dk and dv per key row over the queries that attend to it)
void cp_attention_forward(const KernelContext& ctx, Tensor out, Tensor lse, const Tensor& qkv, const Tensor& kv_all,
                          const ContextSplit& split, int rank, int n_head, int n_kv_head = 0);
void cp_attention_backward(const KernelContext& ctx, Tensor dqkv, Tensor dkv_all, const Tensor& dout,
                           const Tensor& qkv, const Tensor& kv_all, const Tensor& out, const Tensor& lse,
                           const ContextSplit& split, int rank, int n_head, int n_kv_head = 0);
void kv_pack(const KernelContext& ctx, Tensor kv, const Tensor& qkv, int n_head, int n_kv_head = 0);
void kv_unpack(const KernelContext& ctx, Tensor dqkv, const Tensor& dkv, int n_head, int n_kv_head = 0);

// kernels/rmsnorm.h (the residual add fused into the forward)
void rmsnorm_forward(const KernelContext& ctx, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, double eps);
void residual_rmsnorm_forward(const KernelContext& ctx, Tensor res, Tensor y, Tensor rstd, const Tensor& a,
                              const Tensor& b, const Tensor& w, double eps);
void rmsnorm_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                      const Tensor& w, const Tensor& rstd, GradMode dx_mode);

// kernels/qk_norm.h (one warp per head; the weight gradients through block partials)
void qk_rmsnorm_forward(const KernelContext& ctx, Tensor out, Tensor rstd, const Tensor& qkv, const Tensor& q_w,
                        const Tensor& k_w, int n_head, int n_kv_head, double eps);
void qk_rmsnorm_backward(const KernelContext& ctx, Tensor dqkv, Tensor dq_w, Tensor dk_w, const Tensor& dout,
                         const Tensor& qkv, const Tensor& q_w, const Tensor& k_w, const Tensor& rstd, int n_head,
                         int n_kv_head, GradMode dx_mode);

// kernels/rope.h (the table filled on the device from rope_frequencies, in double)
void rope_table(const KernelContext& ctx, Tensor cos, Tensor sin, const RopeConfig& cfg);
void rope_forward(const KernelContext& ctx, Tensor x, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                  int64_t pos_offset);
void rope_backward(const KernelContext& ctx, Tensor dx, const Tensor& cos, const Tensor& sin, int64_t seq_len,
                   int64_t pos_offset);
void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, int64_t seq_len, int64_t pos_offset);
void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, int64_t seq_len, int64_t pos_offset);
void rope_qkv_forward(const KernelContext& ctx, Tensor qkv, const Tensor& cos, const Tensor& sin, int n_head,
                      int n_kv_head, const ContextSplit& split, int rank);
void rope_qkv_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& cos, const Tensor& sin, int n_head,
                       int n_kv_head, const ContextSplit& split, int rank);

// kernels/swiglu.h (separate g, u and the packed [g | u] buffer)
void swiglu_forward(const KernelContext& ctx, Tensor h, const Tensor& g, const Tensor& u);
void swiglu_backward(const KernelContext& ctx, Tensor dg, Tensor du, const Tensor& dh, const Tensor& g,
                     const Tensor& u);
void swiglu_packed_forward(const KernelContext& ctx, Tensor h, const Tensor& gu);
void swiglu_packed_backward(const KernelContext& ctx, Tensor dgu, const Tensor& dh, const Tensor& gu);

// kernels/decode_attention.h (new keys and values appended to the caches, then causal attention over them)
void decode_attention_forward(const KernelContext& ctx, Tensor out, Tensor k_cache, Tensor v_cache, const Tensor& qkv,
                              int64_t pos, int n_head, int n_kv_head);

// kernels/moe.h (router and permutation: moe.cu; grouped product: a loop of
// cuBLASLt products, grouped_matmul.cu)
void router_forward(const KernelContext& ctx, Tensor ids, Tensor gates, Tensor scores, Tensor counts,
                    const Tensor& logits, const Tensor& bias, const RouterOptions& opt);
void router_backward(const KernelContext& ctx, Tensor dlogits, const Tensor& dgates, const Tensor& ids,
                     const Tensor& scores, const RouterOptions& opt);
void moe_permutation(const KernelContext& ctx, Tensor sorted_slots, Tensor slot_rows, Tensor offsets, const Tensor& ids,
                     int64_t num_experts);
void moe_permute(const KernelContext& ctx, Tensor xp, const Tensor& x, const Tensor& sorted_slots);
void moe_permute_backward(const KernelContext& ctx, Tensor dx, const Tensor& dxp, const Tensor& slot_rows);
void moe_unpermute_combine(const KernelContext& ctx, Tensor y, const Tensor& yp, const Tensor& gates,
                           const Tensor& slot_rows);
void moe_unpermute_combine_backward(const KernelContext& ctx, Tensor dyp, Tensor dgates, const Tensor& dy,
                                    const Tensor& yp, const Tensor& gates, const Tensor& slot_rows);
void grouped_matmul_forward(const KernelContext& ctx, Tensor y, const Tensor& x, const Tensor& w,
                            const Tensor& offsets);
void grouped_matmul_backward(const KernelContext& ctx, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                             const Tensor& w, const Tensor& offsets, GradMode dx_mode);

}  // namespace xirang::cuda
