#include "models/layers/tp_comm.h"

#include "core/error.h"

namespace xirang {

TpComm::TpComm(const TensorParallel& tp, int64_t rows) : group_(tp.group), sp_(tp.sequence_parallel), rows_(rows) {
  if (group_) {
    size_ = group_->size();
    rank_ = group_->rank();
  } else if (tp.size > 1) {
    XR_CHECK(0 <= tp.rank && tp.rank < tp.size, "tensor-parallel rank ", tp.rank, " of ", tp.size);
    size_ = tp.size;
    rank_ = tp.rank;
  }
  // In a group of one there is nothing to split: the plain single-rank path.
  if (size_ == 1) sp_ = false;
  XR_CHECK(!sp_ || rows_ % size_ == 0, "sequence parallelism needs B*T ", rows_, " divisible by tp ", size_);
  local_rows_ = sp_ ? rows_ / size_ : rows_;
}

void TpComm::layout(Arena& acts, int64_t width, DType dtype) {
  partial_ = acts.alloc({rows_, width}, dtype, "row-parallel partial sums");
  if (sp_) {
    gather_ = acts.alloc({rows_, width}, dtype, "gathered LayerNorm output");
    grad_ = acts.alloc({rows_, width}, dtype, "gathered residual gradient");
  }
}

// The collective's part of the step and its span: the launch and the wait.
StepClock::Scope TpComm::part(OpKind kind) const {
  return StepClock::Scope(clock_, StepPart::TpComm, {timeline_, op_kind_name(kind)});
}

void TpComm::join(const WorkPtr& w, OpKind kind) {
  w->join(stream_);
  if (stream_) device_work_.push_back(w);
  // A collective's own duration is known once it has completed (at once on the host).
  if (timeline_) timeline_->add_op_later(kind, [w] { return w->duration_ms(); });
}

void TpComm::all_reduce(Tensor t, ReduceOp op) {
  if (size_ == 1) return;
  const StepClock::Scope scope = part(OpKind::TpAllReduce);
  join(group_->all_reduce_async(t, op), OpKind::TpAllReduce);
}

Tensor TpComm::gathered(const Tensor& local) {
  if (!sp_) return local;
  const StepClock::Scope scope = part(OpKind::TpAllGather);
  join(group_->all_gather_async(local, gather_), OpKind::TpAllGather);
  return gather_;
}

void TpComm::reduce_rows(Tensor partial, Tensor out) {
  if (size_ == 1) return;
  const OpKind kind = sp_ ? OpKind::TpReduceScatter : OpKind::TpAllReduce;
  const StepClock::Scope scope = part(kind);
  if (sp_) join(group_->reduce_scatter_async(partial, out, ReduceOp::Sum), kind);
  else join(group_->all_reduce_async(partial, ReduceOp::Sum), kind);
}

Tensor TpComm::full_rows(Tensor local) {
  if (!sp_) return local;
  const StepClock::Scope scope = part(OpKind::TpAllGather);
  join(group_->all_gather_async(local, grad_), OpKind::TpAllGather);
  return grad_;
}

TpCommTime TpComm::take() {
  TpCommTime t{std::move(device_work_)};
  device_work_.clear();
  return t;
}

}  // namespace xirang
