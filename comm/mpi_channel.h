// comm/mpi_channel.h: inside an MPI channel (MpiCommunicator): the worker
// thread that starts and polls every operation, its queue, the operations
// and their Work handles. Private to comm/: mpi_channel.cc runs the worker,
// mpi_communicator.cc submits operations to it.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_trace.h"
#include "comm/mpi_communicator.h"
#include "core/clock.h"
#include "core/error.h"

namespace xirang {
namespace mpi_detail {

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
  bool busy_poll = false;        // CommOptions::busy_poll is On; fixed before any work is handed out
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

// A Comm error carrying `message`, for Work::wait() to rethrow.
std::exception_ptr comm_error(const std::string& message);

}  // namespace mpi_detail

struct MpiCommunicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string name;
  CommOptions opts;
  int rank = 0, size = 1;
  int tag_ub = 32767;  // the smallest MPI_TAG_UB the standard allows, until MPI tells us more
  std::vector<int> world_ranks;  // the group's members' world ranks, by group rank
  int trace_channel = -1;        // this channel in opts.trace
  uint64_t collectives = 0, p2p = 0;  // operations submitted so far (guarded by mu): their sequence numbers

  std::shared_ptr<mpi_detail::WorkerSignal> signal = std::make_shared<mpi_detail::WorkerSignal>();
  std::mutex& mu = signal->mu;  // guards queue, stopping, broken_reason
  std::condition_variable& cv = signal->cv;
  std::deque<std::unique_ptr<mpi_detail::Op>> queue;
  bool stopping = false;
  std::atomic<bool> broken{false};
  std::string broken_reason;
  std::thread worker;

  // Owned by the worker thread alone: the started, not yet completed ops and
  // their requests (parallel arrays, as MPI_Testsome wants the requests contiguous).
  std::vector<std::unique_ptr<mpi_detail::Op>> active;
  std::vector<MPI_Request> reqs;
  std::vector<int> indices;          // MPI_Testsome's outputs, kept to avoid reallocating per poll
  std::vector<MPI_Status> statuses;

  std::string where() const { return str_cat("(this is rank ", rank, " of ", size, " in group ", name, ")"); }
  WorkPtr submit(std::unique_ptr<mpi_detail::Op> op);
  void run();
  void start_op(std::unique_ptr<mpi_detail::Op> op);
  bool poll();
  void check_timeouts();
  void fail_op(mpi_detail::Op& op, std::exception_ptr e) {
    if (opts.trace) opts.trace->completed(op.trace_id, false, now_seconds());
    op.work->complete(op.submitted_s, std::move(e));
  }
  std::string timeout_message(const mpi_detail::Op& op) const;
};

}  // namespace xirang
