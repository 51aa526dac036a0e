#include "comm/ordered_link.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/clock.h"
#include "core/error.h"

namespace xirang {

namespace {

using Clock = std::chrono::steady_clock;

// now_seconds() counts steady-clock seconds since its epoch; this is the
// same instant as a time_point for condition_variable::wait_until.
Clock::time_point time_point_of(double seconds) {
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
}

std::exception_ptr comm_error(const std::string& message) {
  return std::make_exception_ptr(Error(ErrorKind::Comm, message));
}

// The handshake's messages: plain words, sent as u32 elements (point to
// point moves bytes, so the element type only sets the count).
struct Ready {
  int64_t tag = 0, bytes = 0;  // what the receiving side expects
};
struct Status {
  int64_t ok = 0, tag = 0, bytes = 0;  // the sender's verdict and what it sends
};
struct Handshake {
  Ready ready;
  Status status;
};
template <class T>
Tensor words(T& x) {
  static_assert(sizeof(T) % 4 == 0, "handshake messages are whole u32 words");
  return Tensor(&x, {int64_t(sizeof(T) / 4)}, DType::U32);
}

// Inner operations the link gave up on while they were still posted on the
// inner communicator, and the buffers they read or write. The inner finishes
// or times them out on its own schedule, possibly after the link is gone, so
// the buffers are kept for the life of the process (a few words per broken
// link, and a broken link means the job or test case is ending).
void abandon(std::vector<WorkPtr> works, std::shared_ptr<void> keep) {
  static std::mutex mu;
  static std::vector<std::pair<std::vector<WorkPtr>, std::shared_ptr<void>>> graveyard;
  std::lock_guard<std::mutex> lock(mu);
  graveyard.emplace_back(std::move(works), std::move(keep));
}

// Polling schedule of the worker while inner operations are outstanding: a
// Work can only be polled, and the worker must notice a deadline or a broken
// link while it waits. Sleeps double from the minimum to the cap, so a
// prompt peer costs tens of microseconds and a long wait little CPU.
constexpr std::chrono::microseconds kMinBackoff{20};
constexpr std::chrono::microseconds kMaxBackoff{1000};

// ---- State shared by the link, its worker and every Work it handed out (a
// Work may outlive the link).

struct LinkState {
  std::string name;
  int rank = 0, size = 1;
  double timeout_s = 0;

  std::atomic<bool> broken{false};
  mutable std::mutex mu;  // guards reason
  std::string reason;     // the first failure's message

  std::string where() const { return str_cat("(this is rank ", rank, " of ", size, " on ordered link ", name, ")"); }

  // The first failure wins: it is the cause, later ones are its consequences.
  void break_with(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    if (broken.load()) return;
    reason = message;
    broken.store(true);
  }

  std::string why() const {
    std::lock_guard<std::mutex> lock(mu);
    return reason;
  }

  std::string refusal(const std::string& what) const {
    return str_cat(what, " refused: link ", name, " is broken since an earlier operation failed: ", why());
  }
};

// One queued operation's handle. Completed by the worker, or by the deadline
// (timeout_s after submission) through whichever of wait(), test() or the
// worker notices it first; the first completion wins and later ones are
// ignored. A deadline that passes breaks the link.
class OrderedWork final : public Work {
 public:
  OrderedWork(std::shared_ptr<LinkState> link, std::string what)
      : link_(std::move(link)), what_(std::move(what)), submitted_s_(now_seconds()),
        deadline_s_(submitted_s_ + link_->timeout_s) {}

  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, time_point_of(deadline_s_), [&] { return done_.load(); })) {
      lock.unlock();
      expire();
      lock.lock();
      cv_.wait(lock, [&] { return done_.load(); });
    }
    if (error_) std::rethrow_exception(error_);
  }

  // True once the operation finished, successfully or not (a passed deadline
  // counts as a failure); wait() then returns at once or rethrows.
  bool test() override {
    if (done_.load()) return true;
    if (now_seconds() >= deadline_s_) expire();
    return done_.load();
  }

  double duration_ms() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return 1e3 * (end_s_ - submitted_s_);
  }

  void succeed() { complete(nullptr, ""); }

  // Fails the operation with `message` unless it already completed. The link
  // breaks first (with `message` as its reason unless it already was broken),
  // so that whoever sees the error also finds the link broken.
  void fail_with(const std::string& message) { complete(comm_error(message), message); }

  // Fails the operation for its passed deadline (a no-op once it completed).
  void expire() { fail_with(timeout_message()); }

  std::string timeout_message() const {
    return str_cat(what_, " did not complete within ", link_->timeout_s,
                   " s of its submission: with order-matched sends and receives, two ranks whose queues wait on each "
                   "other deadlock (a send waits until the peer's matching recv is at the head of the peer's queue, "
                   "a recv until the peer's matching send is), or a peer rank stopped answering ",
                   link_->where());
  }

  const std::string& what() const { return what_; }
  double deadline_s() const { return deadline_s_; }
  bool done() const { return done_.load(); }

 private:
  void complete(std::exception_ptr error, const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_.load()) return;
      if (error) link_->break_with(reason);
      end_s_ = now_seconds();
      error_ = std::move(error);
      done_.store(true);
    }
    cv_.notify_all();
  }

  std::shared_ptr<LinkState> link_;
  std::string what_;  // "pp send of 4096 bytes to rank 1 with tag 7", for messages
  double submitted_s_, deadline_s_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;  // guarded by mu_
  double end_s_ = 0;          // guarded by mu_
};

}  // namespace

// ---- The worker

struct OrderedLink::Impl {
  Communicator& inner;
  int tag_base;
  std::shared_ptr<LinkState> state;

  struct Op {
    std::shared_ptr<OrderedWork> work;
    std::function<void(Op&)> body;  // runs the operation on the inner communicator; throws on failure
  };

  std::mutex mu;  // guards queue, stopping
  std::condition_variable cv;
  std::deque<std::unique_ptr<Op>> queue;
  bool stopping = false;
  std::thread worker;

  Impl(Communicator& c, int base) : inner(c), tag_base(base) {}

  int ready_tag() const { return tag_base + 0; }
  int status_tag() const { return tag_base + 1; }
  int data_tag() const { return tag_base + 2; }

  WorkPtr submit(std::string what, std::function<void(Op&)> body);
  // Queues an operation of the inner communicator that `start` begins: it
  // starts when it reaches the head of the queue and is awaited there.
  WorkPtr submit_inner(std::string what, std::function<WorkPtr()> start);
  void run();
  void run_op(Op& op);
  WorkPtr post(Op& op, std::vector<WorkPtr>& in_flight, const std::shared_ptr<void>& keep,
               const std::function<WorkPtr()>& start);
  void await(Op& op, std::vector<WorkPtr> works, const std::shared_ptr<void>& keep);
  void send_body(Op& op, const Tensor& t, int peer, int tag);
  void recv_body(Op& op, const Tensor& t, int peer, int tag);
};

WorkPtr OrderedLink::Impl::submit_inner(std::string what, std::function<WorkPtr()> start) {
  return submit(std::move(what), [this, start = std::move(start)](Op& o) {
    std::vector<WorkPtr> step;
    post(o, step, nullptr, start);
    await(o, std::move(step), nullptr);
  });
}

WorkPtr OrderedLink::Impl::submit(std::string what, std::function<void(Op&)> body) {
  auto op = std::make_unique<Op>();
  op->work = std::make_shared<OrderedWork>(state, std::move(what));
  op->body = std::move(body);
  WorkPtr w = op->work;
  if (state->broken.load()) {
    op->work->fail_with(state->refusal(op->work->what()));
    return w;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(std::move(op));
  }
  cv.notify_one();
  return w;
}

void OrderedLink::Impl::run() {
  for (;;) {
    std::unique_ptr<Op> op;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;  // stopping, and everything submitted has run
      op = std::move(queue.front());
      queue.pop_front();
    }
    run_op(*op);
  }
}

// Runs one operation to completion and records its outcome in its Work. No
// exception leaves this function: the worker thread must never terminate
// the process.
void OrderedLink::Impl::run_op(Op& op) {
  OrderedWork& w = *op.work;
  if (w.done()) return;  // its deadline passed while it was queued
  if (state->broken.load()) {
    w.fail_with(state->refusal(w.what()));
    return;
  }
  std::string failure;
  try {
    op.body(op);
    w.succeed();
    return;
  } catch (const Error& e) {
    failure = e.kind() == ErrorKind::Comm ? std::string(e.what()) : str_cat(w.what(), " failed: ", e.what());
  } catch (const std::exception& e) {
    failure = str_cat(w.what(), " failed: ", e.what());
  } catch (...) {
    failure = str_cat(w.what(), " failed with an unknown exception");
  }
  try {
    w.fail_with(failure);
  } catch (...) {
    state->break_with(failure);  // out of memory for the message: the link is broken either way
  }
}

// Starts one inner operation and adds it to `in_flight`. An inner that
// refuses (throws) fails the link's operation with the inner's message; what
// was already in flight is abandoned.
WorkPtr OrderedLink::Impl::post(Op& op, std::vector<WorkPtr>& in_flight, const std::shared_ptr<void>& keep,
                                const std::function<WorkPtr()>& start) {
  try {
    in_flight.push_back(start());
    return in_flight.back();
  } catch (const std::exception& e) {
    if (!in_flight.empty()) abandon(in_flight, keep);
    fail(ErrorKind::Comm, op.work->what(), " failed: the inner communicator refused a step: ", e.what(), " ",
         state->where());
  }
}

// Waits for inner operations by polling them, so that the operation's
// deadline and a broken link are noticed while waiting. Giving up abandons
// the inner operations (and `keep`, the buffers they use) to the inner
// communicator. Rethrows an inner failure as this operation's failure.
void OrderedLink::Impl::await(Op& op, std::vector<WorkPtr> works, const std::shared_ptr<void>& keep) {
  OrderedWork& w = *op.work;
  auto backoff = kMinBackoff;
  for (;;) {
    bool pending = false;
    for (auto& x : works) pending = pending || !x->test();
    if (!pending) break;
    if (w.done() || state->broken.load() || now_seconds() >= w.deadline_s()) {
      abandon(std::move(works), keep);
      if (!w.done() && !state->broken.load()) w.expire();
      if (!w.done()) {
        std::string msg = str_cat(w.what(), " abandoned: link ", state->name, " broke while it ran: ", state->why());
        w.fail_with(msg);
      }
      fail(ErrorKind::Comm, w.what(), " given up");  // unwinds the body; the Work already holds its error
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(2 * backoff, kMaxBackoff);
  }
  for (auto& x : works) {
    try {
      x->wait();
    } catch (const std::exception& e) {
      fail(ErrorKind::Comm, w.what(), " failed on the inner communicator: ", e.what());
    }
  }
}

// The sending half of the handshake: the peer's ready message is the
// rendezvous (it arrives when the peer's matching recv reached the head of
// its queue); the status tells the peer whether the data follows.
void OrderedLink::Impl::send_body(Op& op, const Tensor& t, int peer, int tag) {
  auto hs = std::make_shared<Handshake>();
  std::vector<WorkPtr> step;
  post(op, step, hs, [&] { return inner.recv_async(words(hs->ready), peer, ready_tag()); });
  await(op, std::move(step), hs);
  const Ready want = hs->ready;
  const int64_t bytes = int64_t(t.bytes());
  const bool match = want.tag == tag && want.bytes == bytes;
  hs->status = Status{match ? 1 : 0, tag, bytes};
  step.clear();
  post(op, step, hs, [&] { return inner.send_async(words(hs->status), peer, status_tag()); });
  if (match) post(op, step, hs, [&] { return inner.send_async(t, peer, data_tag()); });
  await(op, std::move(step), hs);
  if (!match)
    fail(ErrorKind::Comm, state->name, " send to rank ", peer, " (tag ", tag, ", ", bytes,
         " bytes) met the peer's recv (tag ", want.tag, ", ", want.bytes,
         " bytes): this link matches sends and receives by order, as NCCL does, and ",
         want.tag != tag ? "the two ranks' orders differ " : "the two sides disagree on the message size ",
         state->where());
}

// The receiving half: announce what this rank expects, learn whether the
// peer's send at the head of its queue is that message, then take the data.
void OrderedLink::Impl::recv_body(Op& op, const Tensor& t, int peer, int tag) {
  auto hs = std::make_shared<Handshake>();
  const int64_t bytes = int64_t(t.bytes());
  hs->ready = Ready{tag, bytes};
  std::vector<WorkPtr> step;
  post(op, step, hs, [&] { return inner.send_async(words(hs->ready), peer, ready_tag()); });
  post(op, step, hs, [&] { return inner.recv_async(words(hs->status), peer, status_tag()); });
  await(op, std::move(step), hs);
  const Status got = hs->status;
  if (!got.ok)
    fail(ErrorKind::Comm, state->name, " recv from rank ", peer, " (tag ", tag, ", ", bytes,
         " bytes) met the peer's send (tag ", got.tag, ", ", got.bytes,
         " bytes): this link matches sends and receives by order, as NCCL does, and ",
         got.tag != tag ? "the two ranks' orders differ " : "the two sides disagree on the message size ",
         state->where());
  step.clear();
  post(op, step, hs, [&] { return inner.recv_async(t, peer, data_tag()); });
  await(op, std::move(step), hs);
}

// ---- OrderedLink

namespace {

void check_host(const std::string& what, const Tensor& t, const char* role) {
  if (t.device() != Device::CPU)
    fail(ErrorKind::Comm, what, ": ", role, " ", t.str(),
         " is not in host memory (an ordered link runs over a host communicator)");
}

void check_p2p(const std::string& what, int peer, int tag, int rank, int size) {
  if (peer < 0 || peer >= size) fail(ErrorKind::Comm, what, ": peer must be a rank in [0, ", size, ")");
  if (tag < 0) fail(ErrorKind::Comm, what, ": tag must be non-negative");
  if (peer == rank)
    fail(ErrorKind::Comm, what, ": a send or recv to this rank itself would wait forever for its other half, as on "
         "the NCCL backend this link emulates");
}

}  // namespace

OrderedLink::OrderedLink(Communicator& inner, std::string name, int tag_base, double timeout_s)
    : impl_(std::make_unique<Impl>(inner, tag_base)) {
  Impl& m = *impl_;
  m.state = std::make_shared<LinkState>();
  LinkState& s = *m.state;
  s.name = std::move(name);
  s.rank = inner.rank();
  s.size = inner.size();
  s.timeout_s = timeout_s;
  if (!(timeout_s > 0)) fail(ErrorKind::Config, "ordered link ", s.name, ": timeout_s must be > 0, got ", timeout_s);
  if (tag_base < 0 || tag_base > INT32_MAX - 2)
    fail(ErrorKind::Config, "ordered link ", s.name, ": tag_base ", tag_base,
         " must leave room for the link's 3 tags [tag_base, tag_base + 3) in non-negative ints");
  m.worker = std::thread([&m] { m.run(); });
}

OrderedLink::~OrderedLink() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stopping = true;
  }
  m.cv.notify_all();
  // Every queued operation ends by its deadline (the worker polls and gives
  // up), or at once on a broken link, so the join is bounded by timeout_s.
  m.worker.join();
}

int OrderedLink::rank() const { return impl_->state->rank; }
int OrderedLink::size() const { return impl_->state->size; }
const std::string& OrderedLink::name() const { return impl_->state->name; }
bool OrderedLink::broken() const { return impl_->state->broken.load(); }

WorkPtr OrderedLink::all_reduce_async(Tensor t, ReduceOp op) {
  Impl& m = *impl_;
  std::string what = str_cat(name(), " all_reduce of ", t.bytes(), " bytes");
  check_host(what, t, "tensor");
  return m.submit_inner(what, [&m, t, op] { return m.inner.all_reduce_async(t, op); });
}

WorkPtr OrderedLink::do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) {
  Impl& m = *impl_;
  std::string what = str_cat(name(), " reduce_scatter of ", in.bytes(), " bytes");
  check_host(what, in, "input");
  check_host(what, out, "output");
  return m.submit_inner(what, [&m, in, out, op] { return m.inner.reduce_scatter_async(in, out, op); });
}

WorkPtr OrderedLink::do_all_gather(const Tensor& in, Tensor out) {
  Impl& m = *impl_;
  std::string what = str_cat(name(), " all_gather of ", out.bytes(), " bytes");
  check_host(what, in, "input");
  check_host(what, out, "output");
  return m.submit_inner(what, [&m, in, out] { return m.inner.all_gather_async(in, out); });
}

WorkPtr OrderedLink::do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                                     const std::vector<int64_t>& recv_counts, int64_t) {
  Impl& m = *impl_;
  std::string what = str_cat(name(), " all_to_all_v of ", send.bytes(), " bytes");
  check_host(what, send, "send tensor");
  check_host(what, recv, "recv tensor");
  return m.submit_inner(what, [&m, send, send_counts, recv, recv_counts] {
    return m.inner.all_to_all_v_async(send, send_counts, recv, recv_counts);
  });
}

WorkPtr OrderedLink::broadcast_async(Tensor t, int root) {
  Impl& m = *impl_;
  std::string what = str_cat(name(), " broadcast of ", t.bytes(), " bytes from rank ", root);
  check_host(what, t, "tensor");
  if (root < 0 || root >= size()) fail(ErrorKind::Comm, what, ": root must be in [0, ", size(), ")");
  return m.submit_inner(what, [&m, t, root] { return m.inner.broadcast_async(t, root); });
}

WorkPtr OrderedLink::send_async(const Tensor& t, int peer, int tag) {
  Impl& m = *impl_;
  std::string what = str_cat(name(), " send of ", t.bytes(), " bytes to rank ", peer, " with tag ", tag);
  check_host(what, t, "tensor");
  check_p2p(what, peer, tag, rank(), size());
  // A no-op on NCCL, where it takes no place in the order (a broken link still refuses it).
  if (t.bytes() == 0 && !broken()) return completed_work();
  return m.submit(what, [&m, t, peer, tag](Impl::Op& o) { m.send_body(o, t, peer, tag); });
}

WorkPtr OrderedLink::recv_async(Tensor t, int peer, int tag) {
  Impl& m = *impl_;
  std::string what = str_cat(name(), " recv of ", t.bytes(), " bytes from rank ", peer, " with tag ", tag);
  check_host(what, t, "tensor");
  check_p2p(what, peer, tag, rank(), size());
  if (t.bytes() == 0 && !broken()) return completed_work();
  return m.submit(what, [&m, t, peer, tag](Impl::Op& o) { m.recv_body(o, t, peer, tag); });
}

// A one-element all-reduce rather than the inner's barrier(), which blocks:
// the worker can then give up on it at the deadline like any operation.
void OrderedLink::barrier() {
  Impl& m = *impl_;
  auto one = std::make_shared<int32_t>(1);
  m.submit(str_cat(name(), " barrier"), [&m, one](Impl::Op& o) {
    std::vector<WorkPtr> step;
    m.post(o, step, one, [&] { return m.inner.all_reduce_async(Tensor(one.get(), {1}, DType::I32), ReduceOp::Sum); });
    m.await(o, std::move(step), one);
  })->wait();
}

}  // namespace xirang
