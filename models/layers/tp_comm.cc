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

void TpComm::all_reduce(Tensor t, ReduceOp op) {
  if (size_ == 1) return;
  Stopwatch sw;
  group_->all_reduce_async(t, op)->join(stream_);
  ms_ += sw.ms();
}

Tensor TpComm::gathered(const Tensor& local) {
  if (!sp_) return local;
  Stopwatch sw;
  group_->all_gather_async(local, gather_)->join(stream_);
  ms_ += sw.ms();
  return gather_;
}

void TpComm::reduce_rows(Tensor partial, Tensor out) {
  if (size_ == 1) return;
  Stopwatch sw;
  WorkPtr w = sp_ ? group_->reduce_scatter_async(partial, out, ReduceOp::Sum)
                  : group_->all_reduce_async(partial, ReduceOp::Sum);
  w->join(stream_);
  ms_ += sw.ms();
}

Tensor TpComm::full_rows(Tensor local) {
  if (!sp_) return local;
  Stopwatch sw;
  group_->all_gather_async(local, grad_)->join(stream_);
  ms_ += sw.ms();
  return grad_;
}

double TpComm::take_ms() {
  const double t = ms_;
  ms_ = 0;
  return t;
}

}  // namespace xirang
