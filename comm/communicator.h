// comm/communicator.h: the collective-communication interface that the
// model and runtime talk to.
//
// A layer never calls MPI or NCCL directly: the runtime hands it the
// Communicator of its group (its tensor-parallel group, say). Every operation
// takes tensor views (count and dtype come from the view) and has an
// asynchronous form that returns a Work handle; the blocking form is the
// asynchronous one followed by wait().
//
//   WorkPtr w = dp.all_reduce_async(bucket, ReduceOp::Sum);  // starts now
//   ... compute ...
//   w->wait();                                               // rethrows a failure
//
// Uneven splits: reduce_scatter and all_gather divide a buffer of n elements
// over the group's `size` ranks as chunk r = [n * r / size, n * (r + 1) / size)
// (split_range below), so any n works for any group size. Their arguments are
// checked here, once, before the backend's hook (do_reduce_scatter,
// do_all_gather) runs, so every backend refuses a wrong chunk with the same
// message.
//
// All-to-all with uneven counts (expert parallelism's dispatch and combine):
// counts are in ROWS of dimension 0 (a token's hidden vector is one row),
// one count per rank of the group, the displacements their prefix sums. The
// rows [off_p, off_p + send_counts[p]) of `send` go to rank p; rank p's rows
// for this rank land at [roff_p, roff_p + recv_counts[p]) of `recv`.
// recv_counts[p] must equal rank p's send_counts[this rank]; exchange_counts
// gives them (an all-to-all of one count per peer):
//
//   std::vector<int64_t> recv_counts = ep.exchange_counts(send_counts);
//   ep.all_to_all_v(tokens_by_peer, send_counts, received, recv_counts);  // (sum, d_model) each
//
// Implementations: LocalCommunicator (the group of one rank; every
// collective is the identity), MpiCommunicator (comm/mpi_communicator.h) and
// SimulatedLink (comm/simulated_link.h), a decorator that adds latency,
// bandwidth and faults for tests and benchmarks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace xirang {

enum class ReduceOp { Sum, Max };

class CommTrace;  // comm/comm_trace.h

// Off: the worker sleeps between polls, at most 50 us while waited on. On:
// it polls without sleeping (yields only) for the first 20 ms of a wait:
// right when the waiting rank's CPUs are its own (idle while it waits),
// wrong when the node's compute threads outnumber its CPUs, since the polls
// would take a CPU from the rank being waited for. Auto: ProcessGrid::
// create_mpi chooses On or Off per node (world_node_layout: the union of
// the node's ranks' affinity masks, capped by a CPU quota, against the sum
// of their compute threads).
enum class BusyPoll { Off, On, Auto };

struct CommOptions {
  double timeout_s = 300;  // an operation outstanding longer than this fails
  // Where the MPI and NCCL channels record their operations and, on a timeout, dump
  // them (comm/comm_trace.h); null: no record. Must outlive the channels.
  CommTrace* trace = nullptr;
  // ProcessGrid::create_mpi: the directory of the CommTrace it creates when
  // `trace` is null (DIR/comm_trace.rank<N>.json; empty: record, never dump).
  std::string trace_dir{};
  // How an MPI channel's worker polls while a caller is blocked in wait()
  // (a message moves only while MPI is called).
  BusyPoll busy_poll = BusyPoll::Off;
  // BusyPoll::Auto: the compute threads each rank runs (its OpenMP team),
  // counted against its node's CPUs.
  int compute_threads = 1;
};

// A pending operation. wait() blocks until it completes and rethrows its
// error (ErrorKind::Comm) if it failed; test() polls without blocking.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;
  // Milliseconds from submission to completion (time queued behind earlier
  // operations of the channel included), so that submission time plus
  // duration is when it completed; valid after wait().
  virtual double duration_ms() const = 0;
  // Makes work queued later on `stream` (a cudaStream_t; null on the host)
  // see the operation's result. Host communicators block like wait(); the
  // NCCL communicator makes the stream wait on the device, and the host
  // goes on (the hot path of device training).
  virtual void join(void* stream) {
    (void)stream;
    wait();
  }
};
using WorkPtr = std::shared_ptr<Work>;

// A Work that is already complete (the identity collectives of a group of one).
WorkPtr completed_work();

// The chunk [begin, end) of rank r when n elements are split over `size` ranks.
inline std::pair<int64_t, int64_t> split_range(int64_t n, int size, int r) {
  return {n * r / size, n * (r + 1) / size};
}

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group's name in messages and metrics ("dp", "tp", "pp", "world").
  virtual const std::string& name() const = 0;

  // In place over all ranks of the group.
  virtual WorkPtr all_reduce_async(Tensor t, ReduceOp op) = 0;
  // out (this rank's chunk of in, see split_range) = reduction of in over
  // ranks. `out` may be that chunk inside `in` (in-place reduce-scatter).
  WorkPtr reduce_scatter_async(const Tensor& in, Tensor out, ReduceOp op);
  // out (all chunks) = concatenation of every rank's in. `in` may be this
  // rank's chunk inside `out` (in-place all-gather).
  WorkPtr all_gather_async(const Tensor& in, Tensor out);
  virtual WorkPtr broadcast_async(Tensor t, int root) = 0;
  // Point-to-point within the group; `tag` distinguishes concurrent messages.
  virtual WorkPtr send_async(const Tensor& t, int peer, int tag) = 0;
  virtual WorkPtr recv_async(Tensor t, int peer, int tag) = 0;
  virtual void barrier() = 0;
  // See the file comment. `send` and `recv` have the same dtype and row size
  // (elements per row of dimension 0; a 1-D tensor's rows are its elements),
  // send.size(0) = sum(send_counts), recv.size(0) = sum(recv_counts), one
  // count per rank of the group, none negative; they must not overlap. The
  // arguments are checked here once, for every backend (one-line Comm error).
  WorkPtr all_to_all_v_async(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                             const std::vector<int64_t>& recv_counts);
  // Blocking: returns recv_counts[p] = rank p's send_counts[this rank]
  // (counts travel as int64, whatever they count). Collective over the group.
  virtual std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send_counts);

  void all_reduce(Tensor t, ReduceOp op) { all_reduce_async(t, op)->wait(); }
  void reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) { reduce_scatter_async(in, out, op)->wait(); }
  void all_gather(const Tensor& in, Tensor out) { all_gather_async(in, out)->wait(); }
  void broadcast(Tensor t, int root) { broadcast_async(t, root)->wait(); }
  void send(const Tensor& t, int peer, int tag) { send_async(t, peer, tag)->wait(); }
  void recv(Tensor t, int peer, int tag) { recv_async(t, peer, tag)->wait(); }
  void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                    const std::vector<int64_t>& recv_counts) {
    all_to_all_v_async(send, send_counts, recv, recv_counts)->wait();
  }
  // Sum of a scalar over the group (losses, norms).
  double all_reduce_sum(double x);

 protected:
  // The backends' reduce-scatter and all-gather. The public forms above have
  // already checked the arguments, the same way for every backend: equal
  // dtypes, the chunk's size, and `out` (`in`) either this rank's chunk of
  // `in` (`out`) or apart from it. What is left is the backend's own rule
  // (host or device memory, a type it cannot reduce).
  virtual WorkPtr do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) = 0;
  virtual WorkPtr do_all_gather(const Tensor& in, Tensor out) = 0;
  // The backends' all-to-all-v, after all_to_all_v_async's checks; `row` is
  // the elements per row (counts times row are element counts).
  virtual WorkPtr do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                                  const std::vector<int64_t>& recv_counts, int64_t row) = 0;
};

// The element offset of each peer's chunk, prefix sums of counts x row:
// counts.size() + 1 entries, the last the total.
std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& counts, int64_t row);

class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(std::string name = "local") : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  WorkPtr all_reduce_async(Tensor, ReduceOp) override { return completed_work(); }
  WorkPtr broadcast_async(Tensor, int) override { return completed_work(); }
  WorkPtr send_async(const Tensor& t, int peer, int tag) override;
  WorkPtr recv_async(Tensor t, int peer, int tag) override;
  void barrier() override {}

 protected:
  WorkPtr do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp) override;
  WorkPtr do_all_gather(const Tensor& in, Tensor out) override;
  WorkPtr do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                          const std::vector<int64_t>& recv_counts, int64_t row) override;

 private:
  std::string name_;
};

}  // namespace xirang
