#include "comm/communicator.h"

#include <cstring>

#include "core/device_memory.h"
#include "core/error.h"

namespace xirang {

namespace {
class DoneWork final : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
  double duration_ms() const override { return 0; }
};
}  // namespace

WorkPtr completed_work() { return std::make_shared<DoneWork>(); }

double Communicator::all_reduce_sum(double x) {
  double v = x;
  all_reduce(Tensor(&v, {1}, DType::F64), ReduceOp::Sum);
  return v;
}

WorkPtr LocalCommunicator::reduce_scatter_async(const Tensor& in, Tensor out, ReduceOp) {
  if (in.numel() != out.numel() || in.dtype() != out.dtype())
    fail(ErrorKind::Comm, name_, " reduce_scatter: input ", in.str(), " and output ", out.str(), " differ");
  if (in.raw() != out.raw()) copy_tensor(out, in);  // device tensors too (the whole device is synchronized first)
  return completed_work();
}

WorkPtr LocalCommunicator::all_gather_async(const Tensor& in, Tensor out) {
  if (in.numel() != out.numel() || in.dtype() != out.dtype())
    fail(ErrorKind::Comm, name_, " all_gather: input ", in.str(), " and output ", out.str(), " differ");
  if (in.raw() != out.raw()) copy_tensor(out, in);  // device tensors too (the whole device is synchronized first)
  return completed_work();
}

WorkPtr LocalCommunicator::send_async(const Tensor&, int peer, int) {
  fail(ErrorKind::Comm, name_, ": send to rank ", peer, " in a group of one");
}

WorkPtr LocalCommunicator::recv_async(Tensor, int peer, int) {
  fail(ErrorKind::Comm, name_, ": recv from rank ", peer, " in a group of one");
}

}  // namespace xirang
