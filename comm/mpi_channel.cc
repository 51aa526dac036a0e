// comm/mpi_channel.cc: the worker thread of an MPI channel: it starts the
// submitted operations with non-blocking MPI calls, polls them, completes
// their Work handles, and fails the ones that outlive comm.timeout_s.
#include "comm/mpi_channel.h"

#include <algorithm>
#include <chrono>

#include "comm/mpi_check.h"

namespace xirang {

using namespace mpi_detail;

namespace mpi_detail {
std::exception_ptr comm_error(const std::string& message) {
  return std::make_exception_ptr(Error(ErrorKind::Comm, message));
}

}  // namespace mpi_detail

namespace {

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
// Where every rank has a CPU of its own (CommOptions::busy_poll) it does
// not sleep at all in those 20 ms, only yields: bench/comm_latency_bench
// on 2 ranks, 2 cores: a 256 KiB all-reduce 114 us instead of 629, 1 MiB
// 272 instead of 738, a 256 KiB send and receive 47 instead of 233.
constexpr double kSpinSeconds = 50e-6;
constexpr std::chrono::microseconds kMinBackoff{20};
constexpr std::chrono::microseconds kMaxBackoff{200};
constexpr double kLongWaitSeconds = 20e-3;
constexpr std::chrono::microseconds kLongWaitBackoff{1000};
// While a caller waits on one of the channel's operations the sleep between
// polls stays at most this (and never reaches the long-wait cap).
constexpr std::chrono::microseconds kWaitedBackoff{50};

}  // namespace

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
      if (signal->woken) {  // a caller began to wait: poll at once, then often
        signal->woken = false;
        backoff = kMinBackoff;
        waited_from = now_seconds();
      }
      // Under busy_poll a waited-on channel polls without sleeping for the
      // first kLongWaitSeconds of the wait (CommOptions::busy_poll).
      const bool waited = signal->waiters.load() > 0;
      if (now_seconds() - last_progress < kSpinSeconds ||
          (signal->busy_poll && waited && now_seconds() - waited_from < kLongWaitSeconds)) {
        lk.unlock();
        std::this_thread::yield();
        lk.lock();
        continue;
      }
      cv.wait_for(lk, backoff, [&] { return !queue.empty() || signal->woken; });
      if (signal->woken) continue;  // poll now; the next round notes the wait
      // Often while a caller has waited less than kLongWaitSeconds (more
      // ranks than cores: longer, the polls would take the core from the
      // rank it waits for), then the usual caps.
      const double now = now_seconds();
      auto cap = waited && now - waited_from < kLongWaitSeconds ? kWaitedBackoff
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

}  // namespace xirang
