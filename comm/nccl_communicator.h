// comm/nccl_communicator.h: the NCCL backend of Communicator, for tensors in
// device memory (builds with CUDA and NCCL only: XIRANG_HAVE_NCCL).
//
// One NcclCommunicator is one channel: an NCCL communicator over a group's
// ranks plus the CUDA stream its operations run on. The runtime makes one
// per kind of traffic so that each has its own stream and order: the tp
// channel on the compute stream (its collectives sit between the layer's
// kernels), the dp gradient channel on a dp stream and the pipeline channel
// on a pp stream, both fed by the compute stream (comm/nccl_groups.h).
//
// Creation is collective over the group: rank 0 of the group makes the
// ncclUniqueId and broadcasts it over `group` (the MPI channel of the same
// ranks; any Communicator works, a LocalCommunicator for a group of one).
//
// Ordering, in device time, around every operation:
// - Input ready: before the operation the channel's stream waits on an event
//   recorded on the input-ready stream at submission, so the operation reads
//   what every kernel queued there before the call wrote. The input-ready
//   stream is the channel's own stream unless set_input_ready_stream() names
//   another one (the compute stream, for a channel on its own stream).
// - Completion: the operation's Work holds an event recorded after it on the
//   channel's stream. join_on_stream(work, stream) (NcclWork::wait_on) makes
//   another stream wait for it on the device; the host does not block. This
//   is the hot path: the optimizer's stream joins the gradient buckets, the
//   next layer's stream joins a pipeline receive. A buffer an operation reads
//   or writes must not be touched by another stream until that stream has
//   joined it (zeroing gradients for the next step included).
// - Work::wait() blocks the host until completion: for barriers, reading a
//   result on the host, shutdown. It polls the event and NCCL's asynchronous
//   error state; after CommOptions::timeout_s from submission it aborts the
//   NCCL communicator (ncclCommAbort) and throws an ErrorKind::Comm error
//   naming the group, the operation and its size. The channel is then broken
//   and refuses later operations.
//
//   CudaStream compute(dev), dp_stream(dev, StreamPriority::High);
//   NcclCommunicator dp(grid.dp_grads(), dev, dp_stream.get(), opts);
//   dp.set_input_ready_stream(compute.get());
//   ... backward kernels on compute ...
//   WorkPtr w = dp.all_reduce_async(bucket, ReduceOp::Sum);  // waits for them on the device
//   ... more backward kernels on compute, overlapping the reduction ...
//   join_on_stream(*w, compute.get());  // optimizer kernels queued after this see the sum
//
// A device-side join cannot time out: a peer that died stalls the joined
// stream. So the host must wait() with a timeout somewhere each step (on the
// step's last operation, or synchronize()), which turns a dead peer into an
// error instead of a hang.
//
// Differences from the MPI backend:
// - Point to point: NCCL matches a send with the peer's recv by order, not
//   by tag (the tag is checked and otherwise ignored), the counts must agree,
//   and a send or recv holds its stream until the peer's matching call
//   arrives. Two ranks that each post a recv before their send on the same
//   stream deadlock; exchange in an order both sides share, or use
//   sendrecv_async, which runs both halves together. A send or recv to this
//   rank itself is refused for the same reason (sendrecv_async allows it).
// - Reductions: f32, f64, bf16, f16, i32, u32; u16 only moves data. NCCL
//   reduces bf16/f16 in its own order, so sums agree with the MPI backend
//   within the rounding bound, not bit for bit.
// - Uneven splits (n not divisible by the group size) are decomposed into
//   grouped per-chunk operations, see do_reduce_scatter/do_all_gather.
// - All-to-all-v is one group of ncclSend/ncclRecv pairs (the rows to this
//   rank itself are a device copy). NCCL cannot see a count that disagrees
//   with the peer's: it hangs (then times out) or leaves rows stale, so the
//   recv counts must come from exchange_counts(), which here runs on the
//   device through a buffer of the channel (one caller at a time).
// - All NCCL calls of a channel are serialized by a mutex, so several
//   threads may submit and wait.
#pragma once

#include <cuda_runtime.h>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/comm_trace.h"
#include "comm/communicator.h"
#include "core/cuda_stream.h"

namespace xirang {

struct NcclState;  // the NCCL handle, the group's identity, the broken flag (nccl_communicator.cc)

// One operation as CommOptions::trace records it (comm/comm_trace.h).
struct NcclTraceOp {
  CommOpKind kind = CommOpKind::AllReduce;
  int peer = -1, tag = -1;  // point-to-point only
  int64_t bytes = 0;
};

// A pending NCCL operation. test() and wait() also check the channel for
// asynchronous NCCL errors and the timeout (see the file comment).
class NcclWork final : public Work {
 public:
  // `trace_ids`: the operation's records in CommOptions::trace, completed when it finishes.
  NcclWork(std::shared_ptr<NcclState> state, std::string what, double submitted_s, CudaEvent start, CudaEvent done,
           std::vector<uint64_t> trace_ids = {});

  void wait() override;
  bool test() override;
  // Device milliseconds from the submission point on the input-ready stream
  // (when the input was ready) to completion, time queued behind earlier
  // operations of the channel included; 0 until the operation has completed.
  double duration_ms() const override;

  // The device-side join: work queued on `stream` after this call runs after
  // the operation. Does not block the host and does not time out.
  void wait_on(cudaStream_t stream) const;
  void join(void* stream) override { wait_on(static_cast<cudaStream_t>(stream)); }
  const std::string& what() const { return what_; }

 private:
  bool poll();  // true once finished, successfully (error_ empty) or not

  std::shared_ptr<NcclState> state_;
  std::string what_;  // "dp all_reduce of 4096 bytes (bf16)", for messages
  double submitted_s_ = 0;
  CudaEvent start_, done_;  // timing events: submission point, completion
  std::mutex mu_;
  bool finished_ = false;
  std::exception_ptr error_;
  std::vector<uint64_t> trace_ids_;
};

// The join for any Work: an NcclWork makes `stream` wait for it on the
// device; any other Work (MPI, a group of one) is waited for on the host,
// which is then the correct, if blocking, join.
void join_on_stream(Work& work, cudaStream_t stream);

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `group` (see the file comment). `device` is this rank's
  // CUDA device; `stream` (on that device, not owned) runs every operation.
  // Fails with ErrorKind::Comm when the device does not exist, NCCL cannot
  // set up the group, or set-up does not finish within opts.timeout_s.
  NcclCommunicator(Communicator& group, int device, cudaStream_t stream, const CommOptions& opts);
  // Waits (up to timeout_s) for the channel's queued work, then releases the
  // NCCL communicator; aborts it instead when it is broken or does not drain.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  const std::string& name() const override;
  int device() const;
  cudaStream_t stream() const { return stream_; }

  // The stream whose queued work produces the inputs of later operations.
  // Default: the channel's own stream. It must be on the channel's device.
  void set_input_ready_stream(cudaStream_t producer);
  cudaStream_t input_ready_stream() const { return input_ready_; }

  WorkPtr all_reduce_async(Tensor t, ReduceOp op) override;
  WorkPtr broadcast_async(Tensor t, int root) override;
  WorkPtr send_async(const Tensor& t, int peer, int tag) override;
  WorkPtr recv_async(Tensor t, int peer, int tag) override;
  // A send to `send_peer` and a receive from `recv_peer` that progress
  // together (one group call), so a ring or pairwise exchange cannot
  // deadlock; either peer may be this rank.
  WorkPtr sendrecv_async(const Tensor& send, int send_peer, Tensor recv, int recv_peer);
  // The counts go through the channel's device buffer and an all-to-all-v;
  // the host waits for the result (with the timeout of wait()).
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send_counts) override;
  // A one-element all-reduce waited for on the host: returns once every rank
  // of the group has reached it and this rank's earlier operations are done.
  void barrier() override;
  // Opens the point-to-point connections to the neighbours r+1 and r-1 now,
  // collectively over the group (two ring exchanges of one float, waited
  // for). NCCL connects a pair lazily at its first send or recv, and that
  // first call waits for the peer's host to make its own first call on the
  // pair: a pipeline that posts receives ahead of its sends would wait on
  // each other forever. Channels carrying pipeline traffic call this once.
  void connect_neighbours();
  // Whether an operation failed or timed out (the channel is then aborted).
  bool broken() const;
  // Aborts the channel now: its kernels stop and later work is refused. For
  // shutting down after another channel failed, when draining this one
  // could wait its whole timeout on a dead peer.
  void abort(const std::string& reason);
  // The host waits (with the timeout and error checks of wait()) for
  // everything queued on the channel's stream so far.
  void synchronize();

 protected:
  // n divisible by the group size: one ncclReduceScatter. Otherwise one
  // ncclReduce per non-empty chunk, rooted at the chunk's owner, all in one
  // NCCL group call: no staging buffer, and about the bytes on the wire of a
  // ring reduce-scatter. `out` may be this rank's chunk of `in` (in place;
  // the rest of `in` is then scratch, as with the MPI backend).
  WorkPtr do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) override;
  // n divisible by the group size: one ncclAllGather. Otherwise one
  // ncclBroadcast per non-empty chunk, rooted at its owner, in one group
  // call. `in` may be this rank's chunk of `out` (in place).
  WorkPtr do_all_gather(const Tensor& in, Tensor out) override;
  // One NCCL group: a send and a receive per other rank with rows to move
  // (zero counts are skipped on both sides, as the counts agree), and a
  // device copy of this rank's own rows, all on the channel's stream.
  WorkPtr do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                          const std::vector<int64_t>& recv_counts, int64_t row) override;

 private:
  // Runs `body` (the operation's NCCL calls on the channel's stream) between
  // the input-ready wait and the completion event; see nccl_communicator.cc.
  // Each of `ops` is recorded in CommOptions::trace as posted and started at
  // submission (NCCL runs it when the stream reaches it) and completed when
  // its Work finishes.
  WorkPtr launch(const std::string& what, const std::vector<NcclTraceOp>& ops,
                 const std::function<void(NcclState&, cudaStream_t)>& body);

  std::shared_ptr<NcclState> state_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t input_ready_ = nullptr;
  void* scratch_ = nullptr;  // one float of device memory for barrier()
  void* counts_ = nullptr;   // exchange_counts(): (2, size, 2) u32, the counts out and in
};

// The channel of `group` on `device` and `stream`: the runtime's factory,
// collective over the group like the constructor.
std::unique_ptr<NcclCommunicator> make_nccl_group(Communicator& group, int device, cudaStream_t stream,
                                                  const CommOptions& opts);

}  // namespace xirang
