#include "comm/mpi_communicator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/comm_trace.h"
#include "comm/mpi_check.h"
#include "comm/mpi_runtime.h"
#include "comm/mpi_types.h"
#include "core/clock.h"
#include "core/error.h"

namespace xirang {

namespace {

// What the channel's worker and its callers share (it outlives either): the
// lock and condition of the worker's queue, and the callers blocked in
// wait(). A caller that waits wakes the worker, which then polls at once
// and keeps polling often for a while (run()): the caller's core is idle
// meanwhile, and a message only moves while MPI is called (a receive that
// arrives while the worker sleeps is seen only when it wakes).
struct WorkerSignal {
  std::mutex mu;  // guards the Impl's queue, stopping, broken_reason, and `woken`
  std::condition_variable cv;
  bool woken = false;            // a caller began to wait since the worker last looked
  std::atomic<int> waiters{0};   // callers blocked in wait() now
};

// ---- Work handles

class MpiWork final : public Work {
 public:
  void wait() override {
    if (done_.load()) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    const std::shared_ptr<WorkerSignal> s = signal_;
    if (s) {
      s->waiters.fetch_add(1);
      {
        std::lock_guard<std::mutex> lk(s->mu);
        s->woken = true;
      }
      s->cv.notify_one();
    }
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return done_.load(); });
    }
    if (s) s->waiters.fetch_sub(1);
    if (error_) std::rethrow_exception(error_);
  }
  void set_signal(std::shared_ptr<WorkerSignal> s) { signal_ = std::move(s); }
  // True once the operation has finished, successfully or not; wait() then
  // returns at once (or rethrows the failure).
  bool test() override { return done_.load(); }
  double duration_ms() const override { return 1e3 * (end_s_ - start_s_); }

  void complete(double start_s, std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      start_s_ = start_s;
      end_s_ = now_seconds();
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  double start_s_ = 0, end_s_ = 0;
  std::shared_ptr<WorkerSignal> signal_;  // set before the work is handed out
};

std::exception_ptr comm_error(const std::string& message) {
  return std::make_exception_ptr(Error(ErrorKind::Comm, message));
}

// An operation from submission to completion. Owned by the queue, then by
// the worker's list of outstanding requests.
struct Op {
  std::shared_ptr<MpiWork> work = std::make_shared<MpiWork>();
  std::string what;                     // "dp all_reduce of 4096 bytes", for messages
  std::function<int(Op&)> start;        // issues the MPI_I* call into `req`; returns its code
  std::function<void(const MPI_Status&)> finish;  // optional check or copy after success; may throw
  bool is_recv = false;
  // What the channel's CommTrace records (set by the submitting method; seq and trace_id by submit()).
  CommOpKind kind = CommOpKind::AllReduce;
  int peer = -1, tag = -1;
  int64_t bytes = 0;
  uint64_t seq = 0, trace_id = 0;
  MPI_Request req = MPI_REQUEST_NULL;
  double submitted_s = 0;  // when the caller submitted it (Work::duration_ms counts from here)
  double started_s = 0;    // when the worker issued it to MPI (timeouts count from here)
  // Non-blocking collectives may read their count and displacement arrays
  // until they complete, so the arrays live as long as the operation.
  std::vector<int> counts, displs;
};

// Ops whose requests were given up while still live inside MPI. MPI may
// read an op's count arrays until its request completes, which may be never,
// so they are kept for the life of the process (a broken channel happens at
// most a few times per job). The caller's buffers cannot be protected the
// same way: a peer that answers late may still write into a receive buffer.
void abandon(std::vector<std::unique_ptr<Op>> ops) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<Op>> graveyard;
  std::lock_guard<std::mutex> lk(mu);
  for (auto& op : ops) graveyard.push_back(std::move(op));
}

// Polling schedule of the worker (see run()). Measured on 2 cores with 2
// and 4 ranks: without the spin a 4-byte all-reduce took 2-3 ms instead of
// 20 us, and a 1000 us cap made 1-4 MB all-reduces 30-60% slower than a
// 200 us one, since sleeps stall a transfer between MPI calls. Once nothing
// has happened for 20 ms (a receive posted early, its sender still
// computing) the cap rises to 1 ms, so a long wait costs about 1% of a core
// instead of 6%, unless a caller is blocked on the channel: then the
// worker polls at once and every 50 us at most (kWaitedBackoff), since the
// caller's core has nothing else to do (for the first 20 ms of a wait:
// with more ranks than cores it may be the core of the rank it waits for).
constexpr double kSpinSeconds = 50e-6;
constexpr std::chrono::microseconds kMinBackoff{20};
constexpr std::chrono::microseconds kMaxBackoff{200};
constexpr double kLongWaitSeconds = 20e-3;
constexpr std::chrono::microseconds kLongWaitBackoff{1000};
// While a caller waits on one of the channel's operations the sleep between
// polls stays at most this (and never reaches the long-wait cap).
constexpr std::chrono::microseconds kWaitedBackoff{50};

}  // namespace

struct MpiCommunicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string name;
  CommOptions opts;
  int rank = 0, size = 1;
  int tag_ub = 32767;  // the smallest MPI_TAG_UB the standard allows, until MPI tells us more
  std::vector<int> world_ranks;  // the group's members' world ranks, by group rank
  int trace_channel = -1;        // this channel in opts.trace
  uint64_t collectives = 0, p2p = 0;  // operations submitted so far (guarded by mu): their sequence numbers

  std::shared_ptr<WorkerSignal> signal = std::make_shared<WorkerSignal>();
  std::mutex& mu = signal->mu;  // guards queue, stopping, broken_reason
  std::condition_variable& cv = signal->cv;
  std::deque<std::unique_ptr<Op>> queue;
  bool stopping = false;
  std::atomic<bool> broken{false};
  std::string broken_reason;
  std::thread worker;

  // Owned by the worker thread alone: the started, not yet completed ops and
  // their requests (parallel arrays, as MPI_Testsome wants the requests contiguous).
  std::vector<std::unique_ptr<Op>> active;
  std::vector<MPI_Request> reqs;
  std::vector<int> indices;          // MPI_Testsome's outputs, kept to avoid reallocating per poll
  std::vector<MPI_Status> statuses;

  std::string where() const { return str_cat("(this is rank ", rank, " of ", size, " in group ", name, ")"); }
  WorkPtr submit(std::unique_ptr<Op> op);
  void run();
  void start_op(std::unique_ptr<Op> op);
  bool poll();
  void check_timeouts();
  void fail_op(Op& op, std::exception_ptr e) {
    if (opts.trace) opts.trace->completed(op.trace_id, false, now_seconds());
    op.work->complete(op.submitted_s, std::move(e));
  }
  std::string timeout_message(const Op& op) const;
};

WorkPtr MpiCommunicator::Impl::submit(std::unique_ptr<Op> op) {
  op->submitted_s = now_seconds();
  op->work->set_signal(signal);
  WorkPtr w = op->work;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (broken) {
      op->work->complete(now_seconds(), comm_error(str_cat(op->what, " refused: channel ", name,
                                                           " is broken since an earlier operation failed: ",
                                                           broken_reason)));
      return w;
    }
    op->seq = is_collective(op->kind) ? ++collectives : ++p2p;
    if (opts.trace)
      op->trace_id = opts.trace->posted(trace_channel, op->kind, op->peer, op->tag, op->bytes, op->seq, op->submitted_s);
    queue.push_back(std::move(op));
  }
  cv.notify_one();
  return w;
}

void MpiCommunicator::Impl::run() {
  auto backoff = kMinBackoff;
  double last_progress = now_seconds();
  double waited_from = -1e30;  // when a caller last began to wait
  std::unique_lock<std::mutex> lk(mu);
  for (;;) {
    if (queue.empty() && active.empty()) {
      if (stopping) return;
      cv.wait(lk, [&] { return stopping || !queue.empty(); });
      continue;
    }
    std::deque<std::unique_ptr<Op>> batch;
    batch.swap(queue);
    lk.unlock();
    bool progress = !batch.empty();
    for (auto& op : batch) start_op(std::move(op));
    progress = poll() || progress;
    check_timeouts();
    lk.lock();
    if (progress) {
      backoff = kMinBackoff;
      last_progress = now_seconds();
    } else if (queue.empty() && !active.empty()) {
      // MPI only moves a transfer along while someone calls it, and we only
      // see completions, not progress within a transfer. So poll with yields
      // for a moment after any event (a peer is usually just behind us),
      // then sleep with a growing backoff so that a long wait does not burn
      // a core that compute (or another rank: ranks often outnumber cores)
      // needs. A new submission wakes the sleep at once.
      if (now_seconds() - last_progress < kSpinSeconds) {
        lk.unlock();
        std::this_thread::yield();
        lk.lock();
        continue;
      }
      cv.wait_for(lk, backoff, [&] { return !queue.empty() || signal->woken; });
      if (signal->woken) {  // a caller began to wait: poll now, then often
        signal->woken = false;
        backoff = kMinBackoff;
        waited_from = now_seconds();
        continue;
      }
      // Often while a caller has waited less than kLongWaitSeconds (more
      // ranks than cores: longer, the polls would take the core from the
      // rank it waits for), then the usual caps.
      const double now = now_seconds();
      auto cap = signal->waiters.load() > 0 && now - waited_from < kLongWaitSeconds ? kWaitedBackoff
                 : now - last_progress < kLongWaitSeconds                           ? kMaxBackoff
                                                                                    : kLongWaitBackoff;
      backoff = std::min(2 * backoff, cap);
    }
  }
}

void MpiCommunicator::Impl::start_op(std::unique_ptr<Op> op) {
  op->started_s = now_seconds();
  if (broken) {
    fail_op(*op, comm_error(str_cat(op->what, " refused: channel ", name, " broke while it was queued")));
    return;
  }
  int rc = op->start(*op);
  if (rc != MPI_SUCCESS) {
    fail_op(*op, comm_error(str_cat(op->what, " could not start: ", mpi_error_string(rc), " ", where())));
    return;
  }
  if (opts.trace) opts.trace->started(op->trace_id, op->started_s);
  reqs.push_back(op->req);
  active.push_back(std::move(op));
}

// Completes the ops whose requests have finished; true when any did.
bool MpiCommunicator::Impl::poll() {
  if (active.empty()) return false;
  int n = int(reqs.size()), outcount = 0;
  indices.resize(reqs.size());
  statuses.resize(reqs.size());
  int rc = MPI_Testsome(n, reqs.data(), &outcount, indices.data(), statuses.data());
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
    std::string msg = str_cat("MPI_Testsome failed on channel ", name, ": ", mpi_error_string(rc), " ", where());
    {
      std::lock_guard<std::mutex> lk(mu);
      broken_reason = msg;
      broken = true;
    }
    for (auto& op : active) fail_op(*op, comm_error(str_cat(op->what, " failed: ", msg)));
    abandon(std::move(active));
    active.clear();
    reqs.clear();  // the requests are leaked on purpose: see ~MpiCommunicator
    return true;
  }
  if (outcount == MPI_UNDEFINED || outcount == 0) return false;
  for (int k = 0; k < outcount; ++k) {
    Op& op = *active[size_t(indices[size_t(k)])];
    const MPI_Status& st = statuses[size_t(k)];
    int err = rc == MPI_ERR_IN_STATUS ? st.MPI_ERROR : MPI_SUCCESS;
    if (err != MPI_SUCCESS) {
      fail_op(op, comm_error(str_cat(op.what, " failed: ", mpi_error_string(err), " ", where())));
      // Some MPIs (Open MPI among them) leave a request that failed allocated.
      int i = indices[size_t(k)];
      if (reqs[size_t(i)] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[size_t(i)]);
      continue;
    }
    std::exception_ptr e;
    try {
      if (op.finish) op.finish(st);
    } catch (...) {
      e = std::current_exception();
    }
    if (opts.trace) opts.trace->completed(op.trace_id, !e, now_seconds());
    op.work->complete(op.submitted_s, e);
  }
  // Testsome set the finished requests to MPI_REQUEST_NULL; drop those ops.
  size_t keep = 0;
  for (size_t i = 0; i < active.size(); ++i) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    reqs[keep] = reqs[i];
    active[keep] = std::move(active[i]);
    ++keep;
  }
  reqs.resize(keep);
  active.resize(keep);
  return true;
}

void MpiCommunicator::Impl::check_timeouts() {
  if (active.empty()) return;
  double now = now_seconds();
  size_t late = active.size();
  for (size_t i = 0; i < active.size(); ++i)
    if (now - active[i]->started_s > opts.timeout_s) {
      late = i;
      break;
    }
  if (late == active.size()) return;
  Op& op = *active[late];
  const std::string msg = timeout_message(op);
  {
    std::lock_guard<std::mutex> lk(mu);
    broken_reason = msg;
    broken = true;
  }
  // A pending receive can be cancelled, which stops MPI from writing into the
  // caller's buffer after we report the failure; collectives and sends cannot.
  if (op.is_recv && MPI_Cancel(&reqs[late]) == MPI_SUCCESS) {
    int done = 0;
    MPI_Status st;
    for (int tries = 0; tries < 100 && !done; ++tries) {
      if (MPI_Test(&reqs[late], &done, &st) != MPI_SUCCESS) break;
      if (!done) std::this_thread::sleep_for(kMinBackoff);
    }
  }
  fail_op(op, comm_error(msg));
  // The channel's ranks no longer agree on what is in flight, so the other
  // outstanding ops cannot be trusted to finish: fail them now rather than
  // one timeout later each.
  for (size_t i = 0; i < active.size(); ++i)
    if (i != late) fail_op(*active[i], comm_error(str_cat(active[i]->what, " abandoned: ", msg)));
  abandon(std::move(active));
  active.clear();
  reqs.clear();
}

// Names the operation as every rank of the group numbers it, the peer of a
// point-to-point one by its world rank, and this rank's dump of its recent
// operations (written here, once per process, before the channel fails).
std::string MpiCommunicator::Impl::timeout_message(const Op& op) const {
  std::string msg = str_cat(op.what, " did not complete within ", opts.timeout_s,
                            " s: a peer rank may have died or stopped answering ", where());
  if (is_collective(op.kind))
    msg += str_cat("; it is collective #", op.seq, " of this ", name, " channel, which a rank of the group never joined");
  else if (op.peer >= 0 && op.peer < int(world_ranks.size()))
    msg += str_cat("; rank ", op.peer, " of group ", name, " is world rank ", world_ranks[size_t(op.peer)],
                   ", which never ", op.is_recv ? "sent" : "received", " it");
  if (opts.trace) {
    const std::string path = opts.trace->dump(msg);
    if (!path.empty())
      msg += str_cat("; recent operations in ", path, " (`xirang diagnose ", opts.trace->dump_dir(),
                     "` compares the ranks' files)");
  }
  return msg;
}

// ---- MpiCommunicator

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
