#include "comm/simulated_link.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <thread>
#include <utility>

#include "core/clock.h"
#include "core/error.h"

namespace xirang {

namespace {

// Sleeps until the steady-clock time `t` (in now_seconds() units). Loops
// because a wake-up may land a hair before the target after the double
// round trip, and callers promise "not before t".
void sleep_until_seconds(double t) {
  using namespace std::chrono;
  for (double now = now_seconds(); now < t; now = now_seconds())
    std::this_thread::sleep_for(duration<double>(t - now));
}

// Bytes one rank puts on the wire for a ring collective over n ranks: the
// factor is 2 for all-reduce (reduce-scatter then all-gather), 1 for either
// half alone. A group of one sends nothing.
double ring_bytes(double factor, int n, size_t bytes) {
  if (n <= 1) return 0;
  return factor * double(n - 1) / double(n) * double(bytes);
}

enum class Fault { None, Fail, Stall };

// Consumes one operation from the fault countdowns. When both land on the
// same operation the failure wins (and the stall is spent): an operation
// that never happened cannot also hang.
Fault take_fault(std::mutex& mu, int& fail_countdown, int& stall_countdown) {
  std::lock_guard<std::mutex> lock(mu);
  Fault fault = Fault::None;
  if (fail_countdown > 0 && --fail_countdown == 0) fault = Fault::Fail;
  if (stall_countdown > 0 && --stall_countdown == 0 && fault == Fault::None) fault = Fault::Stall;
  return fault;
}

// An injected failure. The operation was never handed to the wrapped
// communicator, so no data moved and peers saw nothing; it is complete
// (test() is true) with an error that every wait() rethrows.
class FailedWork final : public Work {
 public:
  explicit FailedWork(std::string message) : message_(std::move(message)) {}
  void wait() override { fail(ErrorKind::Comm, message_); }
  bool test() override { return true; }
  double duration_ms() const override { return 0; }

 private:
  std::string message_;
};

// An injected stall. The operation did go to the wrapped communicator (so
// this rank leaves no peer waiting), but its completion is never reported:
// wait() gives up at the deadline the way a real backend's timeout would.
class StalledWork final : public Work {
 public:
  StalledWork(WorkPtr inner, double deadline, std::string message)
      : inner_(std::move(inner)), deadline_(deadline), message_(std::move(message)) {}
  void wait() override {
    inner_->wait();
    sleep_until_seconds(deadline_);
    fail(ErrorKind::Comm, message_);
  }
  bool test() override { return false; }
  double duration_ms() const override { return inner_->duration_ms(); }

 private:
  WorkPtr inner_;
  double deadline_;  // steady-clock seconds
  std::string message_;
};

// Holds an operation's completion back until the modelled link would have
// delivered it. Only wait() sleeps, so the submitting thread keeps computing
// while the modelled transfer runs. The outcome is cached so wait() can be
// called repeatedly and from any thread; after a failed wait(), test()
// keeps asking the inner Work, so a stalled operation never reads as done.
class LinkWork final : public Work {
 public:
  LinkWork(WorkPtr inner, double start, double done) : inner_(std::move(inner)), start_(start), done_(done) {}

  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!finished_) {
      try {
        inner_->wait();
        sleep_until_seconds(done_);
        succeeded_.store(true);
      } catch (...) {
        error_ = std::current_exception();
      }
      finished_ = true;
    }
    if (error_) std::rethrow_exception(error_);
  }

  // Does not take mu_: a poll must not block behind another thread's wait().
  bool test() override {
    if (succeeded_.load()) return true;
    return inner_->test() && now_seconds() >= done_;
  }

  // From submission to delivery, queueing behind earlier operations included
  // (Work::duration_ms), so submission time + duration is the completion time.
  double duration_ms() const override { return std::max(inner_->duration_ms(), 1e3 * (done_ - start_)); }

 private:
  WorkPtr inner_;
  double start_;  // steady-clock seconds when this operation was submitted
  double done_;   // steady-clock seconds when the modelled link delivers it
  std::mutex mu_;
  bool finished_ = false;  // guarded by mu_
  std::exception_ptr error_;  // guarded by mu_
  std::atomic<bool> succeeded_{false};  // read by test() without mu_
};

// Routes one operation through a pending fault: a failed one is never
// submitted; a stalled one is submitted and then never reports completion.
template <class Submit>
WorkPtr submit_with_fault(Fault fault, const std::string& group, const char* op, size_t bytes, double timeout_s,
                          Submit submit) {
  if (fault == Fault::Fail)
    return std::make_shared<FailedWork>(str_cat("injected transfer failure: ", group, " ", op, " of ", bytes, " bytes"));
  WorkPtr w = submit();
  if (fault == Fault::Stall)
    w = std::make_shared<StalledWork>(std::move(w), now_seconds() + timeout_s,
                                      str_cat(group, " ", op, " of ", bytes, " bytes did not complete within ", timeout_s,
                                              " s: a peer rank may have died or stopped answering"));
  return w;
}

}  // namespace

SimulatedLink::SimulatedLink(std::unique_ptr<Communicator> inner, LinkModel link, double timeout_s)
    : inner_(std::move(inner)), link_(link), timeout_s_(timeout_s) {
  XR_CHECK(inner_ != nullptr, "SimulatedLink needs a communicator to wrap");
  if (!(link_.latency_us >= 0) || !(link_.bandwidth_gbps >= 0))
    fail(ErrorKind::Config, inner_->name(), " simulated link: latency_us ", link_.latency_us, " and bandwidth_gbps ",
         link_.bandwidth_gbps, " must both be >= 0");
  if (!(timeout_s_ > 0))
    fail(ErrorKind::Config, inner_->name(), " simulated link: timeout_s ", timeout_s_, " must be > 0");
}

void SimulatedLink::fail_next(int k) {
  XR_CHECK(k >= 1, name(), " fail_next(", k, "): k counts operations from 1");
  std::lock_guard<std::mutex> lock(mu_);
  fail_countdown_ = k;
}

void SimulatedLink::stall_next(int k) {
  XR_CHECK(k >= 1, name(), " stall_next(", k, "): k counts operations from 1");
  std::lock_guard<std::mutex> lock(mu_);
  stall_countdown_ = k;
}

double SimulatedLink::transfer_seconds(double wire_bytes) const {
  if (link_.bandwidth_gbps <= 0) return 0;
  return wire_bytes / (link_.bandwidth_gbps * 1e9);
}

// The link is one serial resource: an operation starts when it is submitted
// or when the previous one is delivered, whichever is later. Start is taken
// after the inner submission so the model never runs ahead of the real work.
WorkPtr SimulatedLink::wrap(WorkPtr inner, double wire_bytes, const char* /*op*/) {
  const double cost = 1e-6 * link_.latency_us + transfer_seconds(wire_bytes);
  const double submitted = now_seconds();
  double done = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done = std::max(submitted, link_free_at_) + cost;
    link_free_at_ = done;
  }
  return std::make_shared<LinkWork>(std::move(inner), submitted, done);
}

// Each operation below: consume the fault countdowns, submit (unless the
// operation is to fail), then book its slot on the modelled link. A failed
// operation books no slot: on this link it never happened.

WorkPtr SimulatedLink::all_reduce_async(Tensor t, ReduceOp op) {
  const Fault fault = take_fault(mu_, fail_countdown_, stall_countdown_);
  WorkPtr w = submit_with_fault(fault, name(), "all_reduce", t.bytes(), timeout_s_,
                                [&] { return inner_->all_reduce_async(t, op); });
  return fault == Fault::Fail ? w : wrap(std::move(w), ring_bytes(2, size(), t.bytes()), "all_reduce");
}

WorkPtr SimulatedLink::do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) {
  const Fault fault = take_fault(mu_, fail_countdown_, stall_countdown_);
  WorkPtr w = submit_with_fault(fault, name(), "reduce_scatter", in.bytes(), timeout_s_,
                                [&] { return inner_->reduce_scatter_async(in, out, op); });
  return fault == Fault::Fail ? w : wrap(std::move(w), ring_bytes(1, size(), in.bytes()), "reduce_scatter");
}

WorkPtr SimulatedLink::do_all_gather(const Tensor& in, Tensor out) {
  const Fault fault = take_fault(mu_, fail_countdown_, stall_countdown_);
  WorkPtr w = submit_with_fault(fault, name(), "all_gather", out.bytes(), timeout_s_,
                                [&] { return inner_->all_gather_async(in, out); });
  return fault == Fault::Fail ? w : wrap(std::move(w), ring_bytes(1, size(), out.bytes()), "all_gather");
}

WorkPtr SimulatedLink::do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                                       const std::vector<int64_t>& recv_counts, int64_t row) {
  const Fault fault = take_fault(mu_, fail_countdown_, stall_countdown_);
  WorkPtr w = submit_with_fault(fault, name(), "all_to_all_v", send.bytes(), timeout_s_,
                                [&] { return inner_->all_to_all_v_async(send, send_counts, recv, recv_counts); });
  if (fault == Fault::Fail) return w;
  const auto me = size_t(rank());
  const double row_bytes = double(row) * double(dtype_size(send.dtype()));
  const double out = double(send.bytes()) - row_bytes * double(send_counts[me]);
  const double in = double(recv.bytes()) - row_bytes * double(recv_counts[me]);
  return wrap(std::move(w), std::max(out, in), "all_to_all_v");
}

WorkPtr SimulatedLink::broadcast_async(Tensor t, int root) {
  const Fault fault = take_fault(mu_, fail_countdown_, stall_countdown_);
  WorkPtr w = submit_with_fault(fault, name(), "broadcast", t.bytes(), timeout_s_,
                                [&] { return inner_->broadcast_async(t, root); });
  return fault == Fault::Fail ? w : wrap(std::move(w), double(t.bytes()), "broadcast");
}

WorkPtr SimulatedLink::send_async(const Tensor& t, int peer, int tag) {
  const Fault fault = take_fault(mu_, fail_countdown_, stall_countdown_);
  WorkPtr w = submit_with_fault(fault, name(), "send", t.bytes(), timeout_s_,
                                [&] { return inner_->send_async(t, peer, tag); });
  return fault == Fault::Fail ? w : wrap(std::move(w), double(t.bytes()), "send");
}

WorkPtr SimulatedLink::recv_async(Tensor t, int peer, int tag) {
  const Fault fault = take_fault(mu_, fail_countdown_, stall_countdown_);
  WorkPtr w = submit_with_fault(fault, name(), "recv", t.bytes(), timeout_s_,
                                [&] { return inner_->recv_async(t, peer, tag); });
  return fault == Fault::Fail ? w : wrap(std::move(w), double(t.bytes()), "recv");
}

}  // namespace xirang
