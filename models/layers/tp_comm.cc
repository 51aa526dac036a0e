#include "models/layers/tp_comm.h"

#include "core/clock.h"
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

void TpComm::join(const WorkPtr& w, OpKind kind, double t0) {
  w->join(stream_);
  const double t1 = now_seconds();
  if (stream_) device_work_.push_back(w);
  if (!timeline_) return;
  add_span(timeline_, op_kind_name(kind), Track::Main, t0, t1);
  // A collective's own duration is known once it has completed (at once on the host).
  timeline_->add_op_later(kind, [w] { return w->duration_ms(); });
}

void TpComm::all_reduce(Tensor t, ReduceOp op) {
  if (size_ == 1) return;
  StepClock::Scope part(clock_, StepPart::TpComm);
  const double t0 = now_seconds();
  join(group_->all_reduce_async(t, op), OpKind::TpAllReduce, t0);
}

Tensor TpComm::gathered(const Tensor& local) {
  if (!sp_) return local;
  StepClock::Scope part(clock_, StepPart::TpComm);
  const double t0 = now_seconds();
  join(group_->all_gather_async(local, gather_), OpKind::TpAllGather, t0);
  return gather_;
}

void TpComm::reduce_rows(Tensor partial, Tensor out) {
  if (size_ == 1) return;
  StepClock::Scope part(clock_, StepPart::TpComm);
  const double t0 = now_seconds();
  if (sp_) join(group_->reduce_scatter_async(partial, out, ReduceOp::Sum), OpKind::TpReduceScatter, t0);
  else join(group_->all_reduce_async(partial, ReduceOp::Sum), OpKind::TpAllReduce, t0);
}

Tensor TpComm::full_rows(Tensor local) {
  if (!sp_) return local;
  StepClock::Scope part(clock_, StepPart::TpComm);
  const double t0 = now_seconds();
  join(group_->all_gather_async(local, grad_), OpKind::TpAllGather, t0);
  return grad_;
}

TpCommTime TpComm::take() {
  TpCommTime t{std::move(device_work_)};
  device_work_.clear();
  return t;
}

}  // namespace xirang
