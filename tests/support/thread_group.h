// tests/support/thread_group.h: a group of ranks as threads of one process,
// and the communicator between them.
//
// Runtime tests that need several ranks (a pipeline, a data-parallel group)
// run each rank on a thread of the test; no MPI. ThreadWorld is one group:
// comm(r) is rank r's Communicator, which a test may wrap in a SimulatedLink
// (comm/simulated_link.h) for latency.
// - Point-to-point: a send and a receive match by (source, destination,
//   tag) in posting order, as MPI matches them; the data are copied when both
//   are posted, and both complete then.
// - Collectives match by call order (every rank's k-th collective); the last
//   rank to arrive computes the result, summing in rank order in the
//   tensor's dtype (F32 or F64), and completes every rank's operation.
//   All-to-all-v moves bytes (any dtype) and fails every rank when a
//   sender's count for a receiver differs from that receiver's count for it.
// - Every wait fails with a Comm error after timeout_s, so a test whose
//   ranks wait on each other fails rather than hangs.
// An observer per rank sees each operation when it is posted and when it is
// first waited for (tests record a rank's communication in order, and probe
// the step clock there). A send is "unjoined" from its post until its sender
// first waits for it: send_unjoined() tells a pass whether the buffer it is
// about to write is still owned by a send (on a device, only the join orders
// the stream after the transfer's read).
//
//   ThreadWorld world(4);
//   run_ranks(4, [&](int r) {
//     std::unique_ptr<Communicator> c = world.comm(r, "dp");
//     c->all_reduce(x[r], ReduceOp::Sum);    // x[r] = x[0] + x[1] + x[2] + x[3] on every rank
//   });
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "core/clock.h"
#include "core/error.h"

namespace xirang {

// One operation as a rank's observer sees it.
struct CommEvent {
  enum Kind { Send, Recv, AllReduce, ReduceScatter, AllGather, Broadcast, Barrier, AllToAllV };
  Kind kind;
  bool wait = false;  // false: posted now; true: its first wait (or join) begins now
  int64_t id = 0;     // the rank's operation number, from 0 (the same in its post and wait events)
  int peer = -1, tag = -1;  // point-to-point
  Tensor tensor;      // the send's or receive's buffer; a collective's input
  Tensor out;         // a reduce-scatter's, all-gather's or all-to-all-v's output
};

// An all-to-all-v's counts (rows) and elements per row, as posted by one rank.
struct AllToAllCounts {
  std::vector<int64_t> send, recv;
  int64_t row = 0;
};

class ThreadWorld {
 public:
  explicit ThreadWorld(int size, double timeout_s = 10) : size_(size), timeout_s_(timeout_s) {
    observers_.resize(size_t(size));
    unjoined_.resize(size_t(size));
    next_id_.assign(size_t(size), 0);
    coll_seq_.assign(size_t(size), 0);
  }
  int size() const { return size_; }
  // Rank r's communicator (any number per rank; collectives of one world
  // match by call order across all of them).
  std::unique_ptr<Communicator> comm(int rank, std::string name = "world");
  // Called on rank r's thread for each of its operations (set before the ranks run).
  void set_observer(int rank, std::function<void(const CommEvent&)> f) { observers_[size_t(rank)] = std::move(f); }
  // Whether a send of rank r, not yet waited for by r, reads memory overlapping `t`.
  bool send_unjoined(int rank, const Tensor& t);
  // Sends whose buffer changed between their post and the copy (each a line).
  std::vector<std::string> changed_in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    return changed_;
  }

 private:
  friend class ThreadComm;
  friend class ThreadWork;
  struct State {  // one rank's part of one operation
    bool done = false;
    bool waited = false;  // the owner has begun waiting (guarded by the world's mutex)
    std::string error;
    double posted = 0, completed = 0;  // seconds
  };
  struct P2P {
    Tensor t;
    std::shared_ptr<State> state;
    std::vector<char> snapshot;  // a send's bytes when posted
    int src = 0;
  };
  struct Coll {
    CommEvent::Kind kind = CommEvent::Barrier;
    ReduceOp op = ReduceOp::Sum;
    int root = 0;
    std::vector<Tensor> in, out;
    std::vector<AllToAllCounts> counts;  // all-to-all-v, per rank
    std::vector<std::shared_ptr<State>> states;
    int arrived = 0;
  };
  using Key = std::tuple<int, int, int>;  // (source, destination, tag)

  std::shared_ptr<State> post_p2p(bool send, int rank, const Tensor& t, int peer, int tag);
  std::shared_ptr<State> post_collective(int rank, CommEvent::Kind kind, const Tensor& in, const Tensor& out,
                                         ReduceOp op, int root, AllToAllCounts counts = {});
  void deliver(P2P& send, P2P& recv);  // mu_ held
  void compute(Coll& c);               // mu_ held
  void wait(const std::shared_ptr<State>& s, const std::string& what);
  void notify(int rank, const CommEvent& e) {
    if (observers_[size_t(rank)]) observers_[size_t(rank)](e);
  }

  int size_;
  double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, std::deque<P2P>> sends_, recvs_;
  std::map<int64_t, Coll> colls_;
  std::vector<int64_t> coll_seq_;  // per rank: its next collective
  std::vector<int64_t> next_id_;   // per rank: its next operation id (its own thread only)
  std::vector<std::vector<std::pair<Tensor, std::shared_ptr<State>>>> unjoined_;  // per rank: sends not yet waited for
  std::vector<std::function<void(const CommEvent&)>> observers_;
  std::vector<std::string> changed_;
};

class ThreadWork final : public Work {
 public:
  ThreadWork(ThreadWorld& w, int rank, std::shared_ptr<ThreadWorld::State> s, CommEvent e, std::string what)
      : w_(w), rank_(rank), s_(std::move(s)), e_(std::move(e)), what_(std::move(what)) {}
  void wait() override {
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(w_.mu_);
      first = !s_->waited;
      s_->waited = true;
    }
    if (first) {
      CommEvent e = e_;
      e.wait = true;
      w_.notify(rank_, e);
    }
    w_.wait(s_, what_);
  }
  bool test() override {
    std::lock_guard<std::mutex> lock(w_.mu_);
    return s_->done;
  }
  double duration_ms() const override { return 1e3 * (s_->completed - s_->posted); }

 private:
  ThreadWorld& w_;
  int rank_;
  std::shared_ptr<ThreadWorld::State> s_;
  CommEvent e_;
  std::string what_;
};

class ThreadComm final : public Communicator {
 public:
  ThreadComm(ThreadWorld& w, int rank, std::string name) : w_(w), rank_(rank), name_(std::move(name)) {}
  int rank() const override { return rank_; }
  int size() const override { return w_.size(); }
  const std::string& name() const override { return name_; }
  WorkPtr all_reduce_async(Tensor t, ReduceOp op) override {
    return collective(CommEvent::AllReduce, t, t, op, 0, "all_reduce");
  }
  WorkPtr broadcast_async(Tensor t, int root) override {
    return collective(CommEvent::Broadcast, t, t, ReduceOp::Sum, root, "broadcast");
  }
  WorkPtr send_async(const Tensor& t, int peer, int tag) override { return p2p(true, t, peer, tag); }
  WorkPtr recv_async(Tensor t, int peer, int tag) override { return p2p(false, t, peer, tag); }
  void barrier() override { collective(CommEvent::Barrier, Tensor(), Tensor(), ReduceOp::Sum, 0, "barrier")->wait(); }

 protected:
  WorkPtr do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) override {
    return collective(CommEvent::ReduceScatter, in, out, op, 0, "reduce_scatter");
  }
  WorkPtr do_all_gather(const Tensor& in, Tensor out) override {
    return collective(CommEvent::AllGather, in, out, ReduceOp::Sum, 0, "all_gather");
  }
  WorkPtr do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                          const std::vector<int64_t>& recv_counts, int64_t row) override {
    return collective(CommEvent::AllToAllV, send, recv, ReduceOp::Sum, 0, "all_to_all_v",
                      AllToAllCounts{send_counts, recv_counts, row});
  }

 private:
  WorkPtr p2p(bool send, const Tensor& t, int peer, int tag) {
    XR_CHECK(peer >= 0 && peer < size() && peer != rank_, name_, ": ", send ? "send to" : "recv from", " rank ", peer,
             " from rank ", rank_, " of ", size());
    CommEvent e{send ? CommEvent::Send : CommEvent::Recv, false, w_.next_id_[size_t(rank_)]++, peer, tag, t, Tensor()};
    w_.notify(rank_, e);
    auto s = w_.post_p2p(send, rank_, t, peer, tag);
    return std::make_shared<ThreadWork>(w_, rank_, std::move(s), e,
                                        str_cat(name_, " rank ", rank_, send ? " send to " : " recv from ", peer,
                                                " (tag ", tag, ")"));
  }
  WorkPtr collective(CommEvent::Kind kind, const Tensor& in, const Tensor& out, ReduceOp op, int root, const char* what,
                     AllToAllCounts counts = {}) {
    CommEvent e{kind, false, w_.next_id_[size_t(rank_)]++, -1, -1, in, out};
    w_.notify(rank_, e);
    auto s = w_.post_collective(rank_, kind, in, out, op, root, std::move(counts));
    return std::make_shared<ThreadWork>(w_, rank_, std::move(s), e, str_cat(name_, " rank ", rank_, " ", what));
  }
  ThreadWorld& w_;
  int rank_;
  std::string name_;
};

inline std::unique_ptr<Communicator> ThreadWorld::comm(int rank, std::string name) {
  XR_CHECK(rank >= 0 && rank < size_, "ThreadWorld: rank ", rank, " of ", size_);
  return std::make_unique<ThreadComm>(*this, rank, std::move(name));
}

inline bool ThreadWorld::send_unjoined(int rank, const Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& list = unjoined_[size_t(rank)];
  std::erase_if(list, [](const auto& e) { return e.second->waited; });
  const char* a = static_cast<const char*>(t.raw());
  for (const auto& [s, st] : list) {
    const char* b = static_cast<const char*>(s.raw());
    if (a < b + s.bytes() && b < a + t.bytes()) return true;
  }
  return false;
}

inline std::shared_ptr<ThreadWorld::State> ThreadWorld::post_p2p(bool send, int rank, const Tensor& t, int peer,
                                                                 int tag) {
  auto s = std::make_shared<State>();
  s->posted = now_seconds();
  P2P op{t, s, {}, rank};
  if (send) op.snapshot.assign(static_cast<const char*>(t.raw()), static_cast<const char*>(t.raw()) + t.bytes());
  std::lock_guard<std::mutex> lock(mu_);
  if (send) unjoined_[size_t(rank)].emplace_back(t, s);
  const Key key = send ? Key{rank, peer, tag} : Key{peer, rank, tag};
  auto& other = send ? recvs_[key] : sends_[key];
  if (other.empty()) {
    (send ? sends_ : recvs_)[key].push_back(std::move(op));
    return s;
  }
  P2P match = std::move(other.front());
  other.pop_front();
  if (send)
    deliver(op, match);
  else
    deliver(match, op);
  cv_.notify_all();
  return s;
}

inline void ThreadWorld::deliver(P2P& send, P2P& recv) {
  const double now = now_seconds();
  if (send.t.bytes() != recv.t.bytes()) {
    const std::string msg = str_cat("send of ", send.t.str(), " met a recv of ", recv.t.str());
    send.state->error = recv.state->error = msg;
  } else {
    if (std::memcmp(send.snapshot.data(), send.t.raw(), send.t.bytes()) != 0)
      changed_.push_back(str_cat("rank ", send.src, "'s send of ", send.t.str(), " changed before it was delivered"));
    std::memcpy(recv.t.raw(), send.t.raw(), send.t.bytes());
  }
  send.state->done = recv.state->done = true;
  send.state->completed = recv.state->completed = now;
}

inline std::shared_ptr<ThreadWorld::State> ThreadWorld::post_collective(int rank, CommEvent::Kind kind,
                                                                        const Tensor& in, const Tensor& out,
                                                                        ReduceOp op, int root,
                                                                        AllToAllCounts counts) {
  auto s = std::make_shared<State>();
  s->posted = now_seconds();
  std::lock_guard<std::mutex> lock(mu_);
  Coll& c = colls_[coll_seq_[size_t(rank)]++];
  if (c.states.empty()) {
    c.kind = kind;
    c.op = op;
    c.root = root;
    c.in.resize(size_t(size_));
    c.out.resize(size_t(size_));
    c.counts.resize(size_t(size_));
    c.states.resize(size_t(size_));
  }
  c.counts[size_t(rank)] = std::move(counts);
  c.in[size_t(rank)] = in;
  c.out[size_t(rank)] = out;
  c.states[size_t(rank)] = s;
  if (c.kind != kind) s->error = "collectives of different kinds met";
  if (++c.arrived == size_) {
    compute(c);
    const double now = now_seconds();
    for (auto& st : c.states) {
      st->done = true;
      st->completed = now;
    }
    colls_.erase(coll_seq_[size_t(rank)] - 1);
    cv_.notify_all();
  }
  return s;
}

namespace thread_world_detail {
template <class T>
void compute(CommEvent::Kind kind, ReduceOp op, int root, const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
  const int n = int(in.size());
  auto at = [](const Tensor& t, int64_t i) -> T& { return static_cast<T*>(t.raw())[i]; };
  if (kind == CommEvent::AllGather) {
    const int64_t total = out[0].numel();
    std::vector<T> all(static_cast<size_t>(total));
    for (int r = 0; r < n; ++r) {
      auto [b, e] = split_range(total, n, r);
      for (int64_t i = b; i < e; ++i) all[size_t(i)] = at(in[size_t(r)], i - b);
    }
    for (int r = 0; r < n; ++r) std::memcpy(out[size_t(r)].raw(), all.data(), size_t(total) * sizeof(T));
    return;
  }
  const int64_t total = in[0].numel();
  std::vector<T> acc(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    if (kind == CommEvent::Broadcast) {
      acc[size_t(i)] = at(in[size_t(root)], i);
      continue;
    }
    T v = at(in[0], i);
    for (int r = 1; r < n; ++r) v = op == ReduceOp::Sum ? T(v + at(in[size_t(r)], i)) : std::max(v, at(in[size_t(r)], i));
    acc[size_t(i)] = v;
  }
  for (int r = 0; r < n; ++r) {
    if (kind == CommEvent::ReduceScatter) {
      auto [b, e] = split_range(total, n, r);
      std::memcpy(out[size_t(r)].raw(), acc.data() + b, size_t(e - b) * sizeof(T));
    } else {
      std::memcpy(out[size_t(r)].raw(), acc.data(), size_t(total) * sizeof(T));
    }
  }
}
}  // namespace thread_world_detail

inline void ThreadWorld::compute(Coll& c) {
  if (c.kind == CommEvent::Barrier) return;
  for (const auto& st : c.states)
    if (!st->error.empty()) return;
  if (c.kind == CommEvent::AllToAllV) {
    // Rank r's rows for d start at the prefix sum of r's send counts, and
    // land at the prefix sum of d's recv counts; both sides must agree.
    const int n = size_;
    const size_t esz = dtype_size(c.in[0].dtype());
    for (int d = 0; d < n; ++d)
      for (int r = 0; r < n; ++r)
        if (c.counts[size_t(r)].send[size_t(d)] != c.counts[size_t(d)].recv[size_t(r)]) {
          for (auto& st : c.states)
            st->error = str_cat("all_to_all_v: rank ", r, " sends ", c.counts[size_t(r)].send[size_t(d)],
                                " rows to rank ", d, ", which expects ", c.counts[size_t(d)].recv[size_t(r)]);
          return;
        }
    for (int r = 0; r < n; ++r) {
      const std::vector<int64_t> soff = chunk_offsets(c.counts[size_t(r)].send, c.counts[size_t(r)].row);
      for (int d = 0; d < n; ++d) {
        const std::vector<int64_t> roff = chunk_offsets(c.counts[size_t(d)].recv, c.counts[size_t(d)].row);
        const size_t bytes = size_t(soff[size_t(d) + 1] - soff[size_t(d)]) * esz;
        if (bytes == 0) continue;
        std::memcpy(static_cast<char*>(c.out[size_t(d)].raw()) + size_t(roff[size_t(r)]) * esz,
                    static_cast<const char*>(c.in[size_t(r)].raw()) + size_t(soff[size_t(d)]) * esz, bytes);
      }
    }
    return;
  }
  const DType dt = c.in[0].dtype();
  if (dt == DType::F32)
    thread_world_detail::compute<float>(c.kind, c.op, c.root, c.in, c.out);
  else if (dt == DType::F64)
    thread_world_detail::compute<double>(c.kind, c.op, c.root, c.in, c.out);
  else
    for (auto& st : c.states) st->error = str_cat("ThreadWorld reduces F32 and F64, not ", dtype_name(dt));
}

inline void ThreadWorld::wait(const std::shared_ptr<State>& s, const std::string& what) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool done = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_), [&] { return s->done; });
  if (!done) fail(ErrorKind::Comm, what, " did not complete within ", timeout_s_, " s");
  if (!s->error.empty()) fail(ErrorKind::Comm, what, ": ", s->error);
}

// Runs f(rank) for ranks 0..n-1, each on its own thread, and rethrows the
// lowest rank's exception (its message prefixed with the rank) once all
// have ended.
inline void run_ranks(int n, const std::function<void(int rank)>& f) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!errors[size_t(r)]) continue;
    try {
      std::rethrow_exception(errors[size_t(r)]);
    } catch (const std::exception& e) {
      throw std::runtime_error(str_cat("rank ", r, ": ", e.what()));
    }
  }
}

}  // namespace xirang
