// models/layers/cp_comm.h: the context-parallel group's collectives, as an
// attention layer uses them, and the workspaces they pass through.
//
// A chunk with ChunkBatch::cp.size = c > 1 holds c's share of every
// sequence (kernels/context_split.h: two chunks of T / 2c rows, head-tail).
// Attention needs every key and value before its own queries: forward
// packs the rank's k and v columns, all-gathers them over the cp group and
// attends (kernels/cp_attention.h); backward gathers them again rather than
// keeping the gathered copy (so the activations stay 1/c of the sequence,
// as Megatron-Core's all-gather variant does), and reduce-scatters the
// key/value gradients every rank's queries gave back to their owners. The
// workspaces are one set per chunk, shared by its layers: the gathered keys
// and values are never kept between layers.
//
// The ring (parallel.cp_comm = ring; Ring Attention, Megatron-Core's p2p)
// never holds more than two blocks: at step s = 0 .. c-1 rank r computes
// its queries against rank (r - s) mod c's block (kernels/cp_ring_attention.h
// says which chunk pairs that is, and merges the partial results) while it
// sends that block to rank r+1 and receives the next one from rank r-1.
// Backward passes the blocks round again; each block's key/value gradient
// travels behind it, every holder adding its queries' share, and one last
// hop brings the sum home. The waits are the exposed part (step part
// CpComm; op kinds cp_all_gather for the blocks, cp_reduce_scatter for the
// gradients, the collectives they replace); the transfers themselves run
// under the attention of the block in hand.
//
//   CpComm cp(batch.cp, B, T);                 // T: the whole sequence
//   cp.layout(acts, kv_width, q_width, dtype); // kv_width = 2 KV D / tp, q_width = H D / tp
//   cp.begin_pass(ctx);
//   Tensor kv_all = cp.gather_kv(ctx, qkv, H, KV);   // (c, B, T/c, kv_width)
//   cp_attention_backward(ctx, dqkv, cp.kv_grad(), ...);
//   cp.reduce_kv_grad(ctx, dqkv, H, KV);       // dqkv's k and v columns
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "core/step_clock.h"
#include "kernels/context_split.h"
#include "models/model.h"

namespace xirang {

class CpComm {
 public:
  // `batch`: sequences per microbatch; `seq_len`: the whole sequence (T).
  CpComm(const ContextParallel& cp, int64_t batch, int64_t seq_len);

  int size() const { return size_; }
  int rank() const { return rank_; }
  bool split() const { return size_ > 1; }
  const ContextSplit& context_split() const { return split_; }
  // T / c: the rows of each sequence this rank holds.
  int64_t local_seq_len() const { return split_.local_rows(); }
  // A chunk laid out without its group (ContextParallel::size) cannot run.
  bool can_run() const { return size_ == 1 || group_ != nullptr; }

  bool ring() const { return exchange_ == CpExchange::Ring; }

  // The workspaces for keys and values `kv_width` wide per row (2 KV D on
  // this tensor-parallel rank), and for the ring the F32 accumulators of
  // queries `q_width` wide (H D); nothing at c = 1.
  void layout(Arena& acts, int64_t kv_width, int64_t q_width, DType dtype);
  void begin_pass(const KernelContext& ctx) {
    stream_ = ctx.cuda_stream;
    timeline_ = ctx.timeline;
    clock_ = ctx.clock;
  }
  // Every rank's keys and values (c, B, T/c, kv_width) gathered from the k
  // and v columns of each rank's qkv (B, T/c, (H + 2 KV) D); valid until the next call.
  Tensor gather_kv(const KernelContext& ctx, const Tensor& qkv, int n_head, int n_kv_head);
  // (c, B, T/c, kv_width): where cp_attention_backward writes the key/value gradients.
  Tensor kv_grad() const { return dkv_all_; }
  // kv_grad() summed over the group into this rank's rows, written to the k
  // and v columns of dqkv (B, T/c, (H + 2 KV) D).
  void reduce_kv_grad(const KernelContext& ctx, Tensor dqkv, int n_head, int n_kv_head);

  // The ring: out y (B, T/c, H D) and lse (B, H, T/c) of the local queries
  // of qkv against every block (cp_ring.cc).
  void ring_forward(const KernelContext& ctx, Tensor y, Tensor lse, const Tensor& qkv, int n_head, int n_kv_head);
  // All of dqkv (B, T/c, (H + 2 KV) D): its q columns from every block, its
  // k and v columns summed over every rank's queries.
  void ring_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                     const Tensor& lse, int n_head, int n_kv_head);

 private:
  // The collective's part of the step and its span.
  StepClock::Scope part(OpKind kind) const;
  void join(const WorkPtr& w, OpKind kind);
  // The ring's neighbours and the owner of the block in hand at step s.
  int next() const { return (rank_ + 1) % size_; }
  int prev() const { return (rank_ + size_ - 1) % size_; }
  int src_at(int s) const { return (rank_ - s + size_) % size_; }

  Communicator* group_ = nullptr;
  int size_ = 1, rank_ = 0;
  CpExchange exchange_ = CpExchange::AllGather;
  ContextSplit split_;
  int64_t batch_ = 0;
  Tensor kv_;       // (B, T/c, kv_width): this rank's keys and values, packed
  Tensor kv_all_;   // (c, B, T/c, kv_width)
  Tensor dkv_all_;  // (c, B, T/c, kv_width)
  Tensor dkv_;      // (B, T/c, kv_width): this rank's share of the reduced gradient
  // The ring's instead of the four above:
  Tensor ring_kv_[2];   // (B, T/c, kv_width): the block in hand and the one arriving
  Tensor ring_dkv_[2];  // (B, T/c, kv_width): a block's gradient arriving, then sent on
  Tensor dkv_part_;     // (B, T/c, kv_width): this rank's share of the block in hand; the last hop
  Tensor acc_;          // (B, T/c, q_width) F32: forward's output, backward's dq, accumulated
  void* stream_ = nullptr;
  Timeline* timeline_ = nullptr;
  StepClock* clock_ = nullptr;
};

}  // namespace xirang
