// comm/mpi_communicator.cc: MpiCommunicator's operations, each checked and
// handed to the channel's worker (comm/mpi_channel.{h,cc}) as an Op.
#include "comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "comm/mpi_channel.h"
#include "comm/mpi_check.h"
#include "comm/mpi_runtime.h"
#include "comm/mpi_types.h"

namespace xirang {

using namespace mpi_detail;

namespace {

void check_host(const std::string& what, const Tensor& t, const char* role) {
  if (t.device() != Device::CPU)
    fail(ErrorKind::Comm, what, ": ", role, " ", t.str(), " is not in host memory (the MPI backend needs host tensors)");
  if (t.numel() > 0 && !t.defined()) fail(ErrorKind::Comm, what, ": ", role, " ", t.str(), " has no memory");
  if (t.numel() > INT_MAX)
    fail(ErrorKind::Comm, what, ": ", role, " ", t.str(), " has more than ", INT_MAX,
         " elements (MPI counts are int); split it");
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, CommOptions opts) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.name = std::move(name);
  m.opts = opts;
  m.signal->busy_poll = opts.busy_poll == BusyPoll::On;  // Auto is ProcessGrid::create_mpi's to resolve: Off here
  if (!MpiRuntime::active())
    fail(ErrorKind::Comm, "communicator ", m.name, ": MPI is not initialised (create an MpiRuntime first)");
  int provided = MPI_THREAD_SINGLE;
  XR_MPI_CHECK(MPI_Query_thread(&provided));
  if (provided < MPI_THREAD_MULTIPLE)
    fail(ErrorKind::Comm, "communicator ", m.name,
         ": MPI was initialised without MPI_THREAD_MULTIPLE, which its worker thread needs");
  if (!(opts.timeout_s > 0))
    fail(ErrorKind::Comm, "communicator ", m.name, ": timeout_s must be positive, got ", opts.timeout_s);
  XR_MPI_CHECK(MPI_Comm_dup(comm, &m.comm));
  XR_MPI_CHECK(MPI_Comm_set_errhandler(m.comm, MPI_ERRORS_RETURN));
  XR_MPI_CHECK(MPI_Comm_rank(m.comm, &m.rank));
  XR_MPI_CHECK(MPI_Comm_size(m.comm, &m.size));
  void* ub = nullptr;
  int flag = 0;
  XR_MPI_CHECK(MPI_Comm_get_attr(m.comm, MPI_TAG_UB, &ub, &flag));
  if (flag) m.tag_ub = *static_cast<int*>(ub);
  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  XR_MPI_CHECK(MPI_Comm_group(m.comm, &group));
  XR_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> ranks(size_t(m.size));
  for (int r = 0; r < m.size; ++r) ranks[size_t(r)] = r;
  m.world_ranks.resize(size_t(m.size));
  XR_MPI_CHECK(MPI_Group_translate_ranks(group, m.size, ranks.data(), world_group, m.world_ranks.data()));
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  if (opts.trace) m.trace_channel = opts.trace->add_channel(m.name, m.rank, m.world_ranks);
  create_mpi_types();  // the 16-bit types now, on the caller's thread, so that a failure throws here
  m.worker = std::thread([&m] { m.run(); });
}

MpiCommunicator::~MpiCommunicator() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.stopping = true;
  }
  m.cv.notify_all();
  // The worker only ever makes non-blocking MPI calls and drops every request
  // once it times out, so it drains within timeout_s and join cannot hang,
  // even on a broken channel.
  m.worker.join();
  // A broken channel may still hold requests that will never complete (a
  // timed-out collective cannot be cancelled); freeing the communicator under
  // them risks a hang or a crash inside MPI, so it is leaked instead. That is
  // harmless: a broken channel means the job is about to end.
  if (!m.broken && MpiRuntime::active()) MPI_Comm_free(&m.comm);
}

int MpiCommunicator::rank() const { return impl_->rank; }
int MpiCommunicator::size() const { return impl_->size; }
const std::string& MpiCommunicator::name() const { return impl_->name; }

WorkPtr MpiCommunicator::all_reduce_async(Tensor t, ReduceOp op) {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " all_reduce of ", t.bytes(), " bytes");
  o->kind = CommOpKind::AllReduce;
  o->bytes = t.bytes();
  check_host(o->what, t, "tensor");
  MPI_Datatype dt = mpi_type(t.dtype());
  MPI_Op mop = mpi_op(t.dtype(), op);
  MPI_Comm c = m.comm;
  o->start = [t, dt, mop, c](Op& self) {
    return MPI_Iallreduce(MPI_IN_PLACE, t.raw(), int(t.numel()), dt, mop, c, &self.req);
  };
  return m.submit(std::move(o));
}

// The shapes were checked by Communicator::reduce_scatter_async.
WorkPtr MpiCommunicator::do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " reduce_scatter of ", in.bytes(), " bytes");
  o->kind = CommOpKind::ReduceScatter;
  o->bytes = in.bytes();
  check_host(o->what, in, "input");
  check_host(o->what, out, "output");
  const int64_t begin = split_range(in.numel(), m.size, m.rank).first;
  for (int r = 0; r < m.size; ++r) {
    auto [b, e] = split_range(in.numel(), m.size, r);
    o->counts.push_back(int(e - b));
  }
  const bool in_place = out.raw() == static_cast<char*>(in.raw()) + size_t(begin) * dtype_size(in.dtype());
  MPI_Datatype dt = mpi_type(in.dtype());
  MPI_Op mop = mpi_op(in.dtype(), op);
  MPI_Comm c = m.comm;
  if (in_place) {
    // MPI's in-place form leaves this rank's result at the start of the
    // buffer, not at the chunk's offset, so it is moved there afterwards (the
    // other chunks of `in` are scratch after an in-place reduce-scatter).
    o->start = [in, dt, mop, c](Op& self) {
      return MPI_Ireduce_scatter(MPI_IN_PLACE, in.raw(), self.counts.data(), dt, mop, c, &self.req);
    };
    if (begin > 0)
      o->finish = [in, out](const MPI_Status&) { std::memmove(out.raw(), in.raw(), out.bytes()); };
  } else {
    o->start = [in, out, dt, mop, c](Op& self) {
      return MPI_Ireduce_scatter(in.raw(), out.raw(), self.counts.data(), dt, mop, c, &self.req);
    };
  }
  return m.submit(std::move(o));
}

// The shapes were checked by Communicator::all_gather_async.
WorkPtr MpiCommunicator::do_all_gather(const Tensor& in, Tensor out) {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " all_gather of ", out.bytes(), " bytes");
  o->kind = CommOpKind::AllGather;
  o->bytes = out.bytes();
  check_host(o->what, in, "input");
  check_host(o->what, out, "output");
  const int64_t begin = split_range(out.numel(), m.size, m.rank).first;
  for (int r = 0; r < m.size; ++r) {
    auto [b, e] = split_range(out.numel(), m.size, r);
    o->counts.push_back(int(e - b));
    o->displs.push_back(int(b));
  }
  const bool in_place = in.raw() == static_cast<char*>(out.raw()) + size_t(begin) * dtype_size(out.dtype());
  MPI_Datatype dt = mpi_type(out.dtype());
  MPI_Comm c = m.comm;
  const void* send = in_place ? MPI_IN_PLACE : in.raw();
  o->start = [send, in, out, dt, c](Op& self) {
    return MPI_Iallgatherv(send, int(in.numel()), dt, out.raw(), self.counts.data(), self.displs.data(), dt, c,
                           &self.req);
  };
  return m.submit(std::move(o));
}

namespace {
// The element counts and displacements of one side, as MPI's ints. They fit:
// check_host refused a tensor of more than INT_MAX elements, and no count or
// displacement exceeds the tensor's elements.
void int_counts(const std::vector<int64_t>& counts, int64_t row, std::vector<int>& out_counts,
                std::vector<int>& out_displs) {
  const std::vector<int64_t> off = chunk_offsets(counts, row);
  for (size_t p = 0; p < counts.size(); ++p) {
    out_counts.push_back(int(counts[p] * row));
    out_displs.push_back(int(off[p]));
  }
}
}  // namespace

// The arguments were checked by Communicator::all_to_all_v_async. A peer
// whose counts disagree with ours (rank p's send_counts[me] != our
// recv_counts[p]) fails with MPI_ERR_TRUNCATE when it sends more; when it
// sends fewer, MPI reports nothing and the chunk's tail keeps its old values.
WorkPtr MpiCommunicator::do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                                         const std::vector<int64_t>& recv_counts, int64_t row) {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " all_to_all_v of ", send.bytes(), " bytes out, ", recv.bytes(), " bytes in");
  o->kind = CommOpKind::AllToAllV;
  o->bytes = send.bytes();
  check_host(o->what, send, "send tensor");
  check_host(o->what, recv, "recv tensor");
  // Op keeps one pair of arrays: the send side's, then the receive side's.
  std::vector<int> rc, rd;
  int_counts(send_counts, row, o->counts, o->displs);
  int_counts(recv_counts, row, rc, rd);
  const size_t p = size_t(m.size);
  o->counts.insert(o->counts.end(), rc.begin(), rc.end());
  o->displs.insert(o->displs.end(), rd.begin(), rd.end());
  MPI_Datatype dt = mpi_type(send.dtype());
  MPI_Comm c = m.comm;
  o->start = [send, recv, dt, c, p](Op& self) {
    return MPI_Ialltoallv(send.raw(), self.counts.data(), self.displs.data(), dt, recv.raw(), self.counts.data() + p,
                          self.displs.data() + p, dt, c, &self.req);
  };
  return m.submit(std::move(o));
}

WorkPtr MpiCommunicator::broadcast_async(Tensor t, int root) {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " broadcast of ", t.bytes(), " bytes from rank ", root);
  o->kind = CommOpKind::Broadcast;
  o->bytes = t.bytes();
  check_host(o->what, t, "tensor");
  if (root < 0 || root >= m.size) fail(ErrorKind::Comm, o->what, ": root must be in [0, ", m.size, ")");
  MPI_Datatype dt = mpi_type(t.dtype());
  MPI_Comm c = m.comm;
  o->start = [t, dt, root, c](Op& self) { return MPI_Ibcast(t.raw(), int(t.numel()), dt, root, c, &self.req); };
  return m.submit(std::move(o));
}

namespace {
void check_peer(const std::string& what, int peer, int tag, int size, int tag_ub) {
  if (peer < 0 || peer >= size) fail(ErrorKind::Comm, what, ": peer must be a rank in [0, ", size, ")");
  if (tag < 0 || tag > tag_ub) fail(ErrorKind::Comm, what, ": tag must be in [0, ", tag_ub, "]");
}
}  // namespace

WorkPtr MpiCommunicator::send_async(const Tensor& t, int peer, int tag) {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " send of ", t.bytes(), " bytes to rank ", peer, " with tag ", tag);
  o->kind = CommOpKind::Send;
  o->bytes = t.bytes();
  o->peer = peer;
  o->tag = tag;
  check_host(o->what, t, "tensor");
  check_peer(o->what, peer, tag, m.size, m.tag_ub);
  MPI_Datatype dt = mpi_type(t.dtype());
  MPI_Comm c = m.comm;
  o->start = [t, dt, peer, tag, c](Op& self) {
    return MPI_Isend(t.raw(), int(t.numel()), dt, peer, tag, c, &self.req);
  };
  return m.submit(std::move(o));
}

WorkPtr MpiCommunicator::recv_async(Tensor t, int peer, int tag) {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " recv of ", t.bytes(), " bytes from rank ", peer, " with tag ", tag);
  o->kind = CommOpKind::Recv;
  o->bytes = t.bytes();
  o->peer = peer;
  o->tag = tag;
  check_host(o->what, t, "tensor");
  check_peer(o->what, peer, tag, m.size, m.tag_ub);
  MPI_Datatype dt = mpi_type(t.dtype());
  MPI_Comm c = m.comm;
  o->is_recv = true;
  o->start = [t, dt, peer, tag, c](Op& self) {
    return MPI_Irecv(t.raw(), int(t.numel()), dt, peer, tag, c, &self.req);
  };
  // A longer message fails with MPI_ERR_TRUNCATE; a shorter one would leave
  // the tail of the buffer stale without any error, so it is checked here.
  std::string what = o->what, where = m.where();
  o->finish = [t, dt, what, where](const MPI_Status& st) {
    int got = 0;
    MPI_Get_count(&st, dt, &got);
    if (got != t.numel())
      fail(ErrorKind::Comm, what, " received ", got, " elements but expected ", t.numel(), " ", where);
  };
  return m.submit(std::move(o));
}

void MpiCommunicator::barrier() {
  Impl& m = *impl_;
  auto o = std::make_unique<Op>();
  o->what = str_cat(m.name, " barrier");
  o->kind = CommOpKind::Barrier;
  MPI_Comm c = m.comm;
  o->start = [c](Op& self) { return MPI_Ibarrier(c, &self.req); };
  m.submit(std::move(o))->wait();
}

}  // namespace xirang

