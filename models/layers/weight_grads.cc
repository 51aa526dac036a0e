#include "models/layers/weight_grads.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "kernels/matmul.h"

namespace xirang {

namespace {
constexpr int64_t kAlign = 256;
int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void WeightGradQueue::bind(Tensor storage, const void* own_begin, const void* own_end) {
  storage_ = storage;
  capacity_ = int64_t(storage.bytes());
  used_ = 0;
  own_begin_ = static_cast<const char*>(own_begin);
  own_end_ = static_cast<const char*>(own_end);
  entries_.clear();
}

int64_t WeightGradQueue::bytes_for(const std::vector<int64_t>& tensor_bytes) {
  int64_t n = 0;
  for (int64_t b : tensor_bytes) n += aligned(b);
  return n;
}

Tensor WeightGradQueue::keep(const KernelContext& ctx, const Tensor& t) {
  const char* p = static_cast<const char*>(t.raw());
  if (p && own_begin_ && p >= own_begin_ && p + t.bytes() <= own_end_) return t;
  const int64_t need = aligned(int64_t(t.bytes()));
  XR_CHECK(used_ + need <= capacity_, "weight-gradient queue: ", t.str(), " does not fit in what is left of ",
           capacity_, " bytes (", used_, " used)");
  Tensor copy(static_cast<char*>(storage_.raw()) + used_, t.shape(), t.dtype(), storage_.device());
  used_ += need;
  copy_tensor(copy, t, ctx.cuda_stream, false);  // in stream order on a device
  return copy;
}

void WeightGradQueue::product(const KernelContext& ctx, Tensor dw, const Tensor& w, const Tensor& dy,
                              const Tensor& x) {
  Entry e{Entry::Product, dw, w, keep(ctx, dy), keep(ctx, x), 0};
  entries_.push_back(std::move(e));
}

void WeightGradQueue::layer_done(int layer) { entries_.push_back(Entry{Entry::Done, {}, {}, {}, {}, layer}); }

void WeightGradQueue::run(const KernelContext& ctx, const std::function<void(int)>& ready) {
  for (Entry& e : entries_) {
    switch (e.kind) {
      case Entry::Product: linear_backward(ctx, Tensor(), e.dw, Tensor(), e.dy, e.x, e.w, GradMode::Overwrite); break;
      case Entry::Done:
        if (ready) ready(e.layer);
        break;
    }
  }
  entries_.clear();
  used_ = 0;
}

}  // namespace xirang
