#include "models/layers/cp_comm.h"

#include "core/error.h"
#include "kernels/cp_attention.h"

namespace xirang {

CpComm::CpComm(const ContextParallel& cp, int64_t batch, int64_t seq_len)
    : group_(cp.group), exchange_(cp.exchange), batch_(batch) {
  if (group_) {
    size_ = group_->size();
    rank_ = group_->rank();
  } else if (cp.size > 1) {
    XR_CHECK(0 <= cp.rank && cp.rank < cp.size, "context-parallel rank ", cp.rank, " of ", cp.size);
    size_ = cp.size;
    rank_ = cp.rank;
  }
  XR_CHECK(size_ == 1 || seq_len % (2 * size_) == 0, "context parallelism needs seq_len ", seq_len,
           " divisible by 2 x cp = ", 2 * size_);
  split_ = ContextSplit::of(seq_len, size_, cp.head_tail);
}

void CpComm::layout(Arena& acts, int64_t kv_width, int64_t q_width, DType dtype) {
  if (!split()) return;
  const int64_t T = local_seq_len(), c = size_;
  if (ring()) {
    for (Tensor& t : ring_kv_) t = acts.alloc({batch_, T, kv_width}, dtype, "ring keys and values");
    for (Tensor& t : ring_dkv_) t = acts.alloc({batch_, T, kv_width}, dtype, "ring key/value gradients");
    dkv_part_ = acts.alloc({batch_, T, kv_width}, dtype, "ring key/value gradient, this rank's part");
    acc_ = acts.alloc({batch_, T, q_width}, DType::F32, "ring attention accumulator");
    return;
  }
  kv_ = acts.alloc({batch_, T, kv_width}, dtype, "context-parallel keys and values");
  kv_all_ = acts.alloc({c, batch_, T, kv_width}, dtype, "gathered keys and values");
  dkv_all_ = acts.alloc({c, batch_, T, kv_width}, dtype, "gathered key/value gradients");
  dkv_ = acts.alloc({batch_, T, kv_width}, dtype, "reduced key/value gradients");
}

StepClock::Scope CpComm::part(OpKind kind) const {
  return StepClock::Scope(clock_, StepPart::CpComm, {timeline_, op_kind_name(kind)});
}

void CpComm::join(const WorkPtr& w, OpKind kind) {
  w->join(stream_);
  if (timeline_) timeline_->add_op_later(kind, [w] { return w->duration_ms(); });
}

Tensor CpComm::gather_kv(const KernelContext& ctx, const Tensor& qkv, int n_head, int n_kv_head) {
  XR_CHECK(split() && group_, "CpComm::gather_kv without a context-parallel group");
  kv_pack(ctx, kv_, qkv, n_head, n_kv_head);
  const StepClock::Scope scope = part(OpKind::CpAllGather);
  join(group_->all_gather_async(kv_, kv_all_), OpKind::CpAllGather);
  return kv_all_;
}

void CpComm::reduce_kv_grad(const KernelContext& ctx, Tensor dqkv, int n_head, int n_kv_head) {
  XR_CHECK(split() && group_, "CpComm::reduce_kv_grad without a context-parallel group");
  {
    const StepClock::Scope scope = part(OpKind::CpReduceScatter);
    join(group_->reduce_scatter_async(dkv_all_, dkv_, ReduceOp::Sum), OpKind::CpReduceScatter);
  }
  kv_unpack(ctx, dqkv, dkv_, n_head, n_kv_head);
}

}  // namespace xirang
