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

std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& counts, int64_t row) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t p = 0; p < counts.size(); ++p) off[p + 1] = off[p] + counts[p] * row;
  return off;
}

namespace {

// Elements per row of dimension 0: the product of the other dimensions (a
// 1-D tensor's rows are its elements). -1 for a tensor without dimensions.
int64_t row_elements(const Tensor& t) {
  if (t.rank() < 1) return -1;
  int64_t row = 1;
  for (int d = 1; d < t.rank(); ++d) row *= t.size(d);
  return row;
}

std::string counts_str(const std::vector<int64_t>& c) {
  std::string s = "[";
  for (size_t i = 0; i < c.size(); ++i) s += str_cat(i ? ", " : "", c[i]);
  return s + "]";
}

// Checks one side's counts: one per rank, none negative, summing to the rows.
void check_counts(const std::string& what, const char* role, const std::vector<int64_t>& counts, const Tensor& t,
                  const Communicator& c) {
  if (int64_t(counts.size()) != c.size())
    fail(ErrorKind::Comm, what, ": ", role, "_counts has ", counts.size(), " entries ", counts_str(counts),
         ", expected one per rank of the group (", c.size(), ") ", where(c));
  int64_t sum = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] < 0)
      fail(ErrorKind::Comm, what, ": ", role, "_counts[", p, "] = ", counts[p], " is negative ", where(c));
    sum += counts[p];
  }
  if (sum != t.size(0))
    fail(ErrorKind::Comm, what, ": ", role, "_counts ", counts_str(counts), " sum to ", sum, " rows but the ", role,
         " tensor ", t.str(), " has ", t.size(0), " ", where(c));
}

}  // namespace

WorkPtr Communicator::all_to_all_v_async(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                                         const std::vector<int64_t>& recv_counts) {
  auto what = [&] { return str_cat(name(), " all_to_all_v (", dtype_name(send.dtype()), ")"); };
  if (send.dtype() != recv.dtype())
    fail(ErrorKind::Comm, what(), ": send ", send.str(), " and recv ", recv.str(), " have different dtypes ", where(*this));
  const int64_t row = row_elements(send);
  if (row < 0 || row_elements(recv) < 0)
    fail(ErrorKind::Comm, what(), ": send ", send.str(), " and recv ", recv.str(),
         " need a dimension 0 (counts are rows of it) ", where(*this));
  if (row != row_elements(recv))
    fail(ErrorKind::Comm, what(), ": send ", send.str(), " has ", row, " elements per row but recv ", recv.str(), " has ",
         row_elements(recv), " ", where(*this));
  check_counts(what(), "send", send_counts, send, *this);
  check_counts(what(), "recv", recv_counts, recv, *this);
  // This rank's chunk to itself is the one pair both sides of which are here.
  const auto me = size_t(rank());
  if (send_counts[me] != recv_counts[me])
    fail(ErrorKind::Comm, what(), ": send_counts[", me, "] = ", send_counts[me], " but recv_counts[", me, "] = ",
         recv_counts[me], ": this rank's rows to itself must be the same on both sides ", where(*this));
  if (overlaps(send, recv))
    fail(ErrorKind::Comm, what(), ": send ", send.str(), " and recv ", recv.str(), " overlap ", where(*this));
  return do_all_to_all_v(send, send_counts, recv, recv_counts, row);
}

// Counts travel as two u32 words each (there is no 64-bit integer dtype):
// one row of (low, high) per peer, bit for bit.
std::vector<int64_t> Communicator::exchange_counts(const std::vector<int64_t>& send_counts) {
  const int p = size();
  if (int64_t(send_counts.size()) != p)
    fail(ErrorKind::Comm, name(), " exchange_counts: ", send_counts.size(), " counts ", counts_str(send_counts),
         ", expected one per rank of the group (", p, ") ", where(*this));
  std::vector<uint32_t> out(2 * size_t(p)), in(2 * size_t(p));
  for (int r = 0; r < p; ++r) {
    if (send_counts[size_t(r)] < 0)
      fail(ErrorKind::Comm, name(), " exchange_counts: count for rank ", r, " is ", send_counts[size_t(r)],
           " (negative) ", where(*this));
    const auto u = uint64_t(send_counts[size_t(r)]);
    out[2 * size_t(r)] = uint32_t(u);
    out[2 * size_t(r) + 1] = uint32_t(u >> 32);
  }
  const std::vector<int64_t> ones(size_t(p), 1);
  all_to_all_v(Tensor(out.data(), {int64_t(p), 2}, DType::U32), ones, Tensor(in.data(), {int64_t(p), 2}, DType::U32), ones);
  std::vector<int64_t> got(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r)
    got[size_t(r)] = int64_t(uint64_t(in[2 * size_t(r)]) | uint64_t(in[2 * size_t(r) + 1]) << 32);
  return got;
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

// A group of one sends its only chunk to itself (the checks made the counts equal).
WorkPtr LocalCommunicator::do_all_to_all_v(const Tensor& send, const std::vector<int64_t>&, Tensor recv,
                                           const std::vector<int64_t>&, int64_t) {
  if (send.numel() > 0) copy_tensor(recv.flat(), send.flat());
  return completed_work();
}

WorkPtr LocalCommunicator::send_async(const Tensor&, int peer, int) {
  fail(ErrorKind::Comm, name_, ": send to rank ", peer, " in a group of one");
}

WorkPtr LocalCommunicator::recv_async(Tensor, int peer, int) {
  fail(ErrorKind::Comm, name_, ": recv from rank ", peer, " in a group of one");
}

}  // namespace xirang
