#include "comm/communicator.h"

#include <cstring>
#include <string>

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

// Whether a and b share memory. A tensor without memory shares none: the
// backend reports it in its own words.
bool overlaps(const Tensor& a, const Tensor& b) {
  auto pa = static_cast<const char*>(a.raw()), pb = static_cast<const char*>(b.raw());
  return pa && pb && a.bytes() > 0 && b.bytes() > 0 && pa < pb + b.bytes() && pb < pa + a.bytes();
}

const char* element(const Tensor& t, int64_t i) {
  return static_cast<const char*>(t.raw()) + size_t(i) * dtype_size(t.dtype());
}

std::string where(const Communicator& c) {
  return str_cat("(this is rank ", c.rank(), " of ", c.size(), " in group ", c.name(), ")");
}

}  // namespace

WorkPtr completed_work() { return std::make_shared<DoneWork>(); }

double Communicator::all_reduce_sum(double x) {
  double v = x;
  all_reduce(Tensor(&v, {1}, DType::F64), ReduceOp::Sum);
  return v;
}

// The description is only built on failure: these run once per gradient
// bucket in every step.
WorkPtr Communicator::reduce_scatter_async(const Tensor& in, Tensor out, ReduceOp op) {
  auto what = [&] { return str_cat(name(), " reduce_scatter of ", in.bytes(), " bytes (", dtype_name(in.dtype()), ")"); };
  if (in.dtype() != out.dtype())
    fail(ErrorKind::Comm, what(), ": input ", in.str(), " and output ", out.str(), " have different dtypes");
  auto [begin, end] = split_range(in.numel(), size(), rank());
  if (out.numel() != end - begin)
    fail(ErrorKind::Comm, what(), ": output ", out.str(), " must hold this rank's chunk of input ", in.str(),
         ", which is ", end - begin, " elements [", begin, ", ", end, ") ", where(*this));
  if (overlaps(in, out) && out.raw() != element(in, begin))
    fail(ErrorKind::Comm, what(), ": output ", out.str(), " overlaps input ", in.str(),
         " without being this rank's chunk of it");
  return do_reduce_scatter(in, out, op);
}

WorkPtr Communicator::all_gather_async(const Tensor& in, Tensor out) {
  auto what = [&] { return str_cat(name(), " all_gather of ", out.bytes(), " bytes (", dtype_name(out.dtype()), ")"); };
  if (in.dtype() != out.dtype())
    fail(ErrorKind::Comm, what(), ": input ", in.str(), " and output ", out.str(), " have different dtypes");
  auto [begin, end] = split_range(out.numel(), size(), rank());
  if (in.numel() != end - begin)
    fail(ErrorKind::Comm, what(), ": input ", in.str(), " must be this rank's chunk of output ", out.str(),
         ", which is ", end - begin, " elements [", begin, ", ", end, ") ", where(*this));
  if (overlaps(in, out) && in.raw() != element(out, begin))
    fail(ErrorKind::Comm, what(), ": input ", in.str(), " overlaps output ", out.str(),
         " without being this rank's chunk of it");
  return do_all_gather(in, out);
}

// A group of one: the chunk is the whole buffer.
WorkPtr LocalCommunicator::do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp) {
  if (in.raw() != out.raw()) copy_tensor(out, in);  // device tensors too (the whole device is synchronized first)
  return completed_work();
}

WorkPtr LocalCommunicator::do_all_gather(const Tensor& in, Tensor out) {
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
