// The ring variant of CpComm (models/layers/cp_comm.h): key/value blocks
// passed around the cp group while attention works on the block in hand.
//
// Buffers: ring_kv_[s % 2] holds step s's block while ring_kv_[(s+1) % 2]
// receives the next one (its send at step s-1 finished before step s began:
// each step ends by joining its transfers). Backward also sends each
// block's key/value gradient on behind the block: at step s >= 1 this
// rank's share of block src_at(s) goes into dkv_part_ while the sum of the
// earlier holders' shares arrives in ring_dkv_[s % 2]; the two are added and
// sent to the next rank, which holds that block at step s + 1. After the
// last step the sum of every rank's share of this rank's own block arrives
// from the previous rank (into dkv_part_, free by then). Messages between
// two ranks keep their order, so one tag per kind of message suffices, also
// at c = 2 where next and prev are the same rank.
#include "core/error.h"
#include "kernels/cp_attention.h"
#include "kernels/cp_ring_attention.h"
#include "kernels/elementwise.h"
#include "models/layers/cp_comm.h"

namespace xirang {

namespace {
constexpr int kKvTag = 0;    // a block of keys and values
constexpr int kGradTag = 1;  // a block's key/value gradient, partly summed
// In the op profile and the trace the waits count as the collectives they
// replace: the blocks' passes as cp_all_gather, the gradients' as cp_reduce_scatter.
constexpr OpKind kKvOp = OpKind::CpAllGather, kGradOp = OpKind::CpReduceScatter;
}  // namespace

void CpComm::ring_forward(const KernelContext& ctx, Tensor y, Tensor lse, const Tensor& qkv, int n_head,
                          int n_kv_head) {
  XR_CHECK(split() && ring() && group_, "CpComm::ring_forward without a context-parallel ring");
  kv_pack(ctx, ring_kv_[0], qkv, n_head, n_kv_head);
  cp_ring_forward_begin(ctx, acc_, lse);
  for (int s = 0; s < size_; ++s) {
    const Tensor& block = ring_kv_[s % 2];
    WorkPtr send, recv;
    if (s + 1 < size_) {
      send = group_->send_async(block, next(), kKvTag);
      recv = group_->recv_async(ring_kv_[(s + 1) % 2], prev(), kKvTag);
    }
    cp_ring_forward_step(ctx, acc_, lse, qkv, block, split_, rank_, src_at(s), n_head, n_kv_head);
    if (send) {
      const StepClock::Scope scope = part(kKvOp);
      join(send, kKvOp);
      join(recv, kKvOp);
    }
  }
  cp_ring_forward_end(ctx, y, acc_);
}

void CpComm::ring_backward(const KernelContext& ctx, Tensor dqkv, const Tensor& dy, const Tensor& qkv,
                           const Tensor& y, const Tensor& lse, int n_head, int n_kv_head) {
  XR_CHECK(split() && ring() && group_, "CpComm::ring_backward without a context-parallel ring");
  kv_pack(ctx, ring_kv_[0], qkv, n_head, n_kv_head);
  cp_ring_backward_begin(ctx, acc_);
  WorkPtr grad_sent[2];  // the last send from each ring_dkv_ buffer
  for (int s = 0; s < size_; ++s) {
    const Tensor& block = ring_kv_[s % 2];
    Tensor& sum = ring_dkv_[s % 2];
    WorkPtr send, recv, grad_recv;
    if (s + 1 < size_) {
      send = group_->send_async(block, next(), kKvTag);
      recv = group_->recv_async(ring_kv_[(s + 1) % 2], prev(), kKvTag);
    }
    if (s > 0) {
      if (grad_sent[s % 2]) {  // sent two steps ago: long done unless the link is far behind
        const StepClock::Scope scope = part(kGradOp);
        join(grad_sent[s % 2], kGradOp);
      }
      grad_recv = group_->recv_async(sum, prev(), kGradTag);
    }
    // Step 0 (this rank's own block) starts the sum; later steps add to it.
    cp_ring_backward_step(ctx, acc_, s == 0 ? sum : dkv_part_, dy, qkv, block, y, lse, split_, rank_, src_at(s),
                          n_head, n_kv_head);
    if (send) {
      const StepClock::Scope scope = part(kKvOp);
      join(send, kKvOp);
      join(recv, kKvOp);
    }
    if (grad_recv) {
      const StepClock::Scope scope = part(kGradOp);
      join(grad_recv, kGradOp);
    }
    if (s > 0) add(ctx, sum, sum, dkv_part_);
    grad_sent[s % 2] = group_->send_async(sum, next(), kGradTag);
  }
  cp_ring_backward_end(ctx, dqkv, acc_, n_head, n_kv_head);
  {  // the last hop: every rank's share of this rank's block
    const StepClock::Scope scope = part(kGradOp);
    join(group_->recv_async(dkv_part_, prev(), kGradTag), kGradOp);
    for (const WorkPtr& w : grad_sent)
      if (w) join(w, kGradOp);
  }
  kv_unpack(ctx, dqkv, dkv_part_, n_head, n_kv_head);
}

}  // namespace xirang
