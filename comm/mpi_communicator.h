// comm/mpi_communicator.h: the MPI backend of Communicator.
//
// Each MpiCommunicator is one channel: its own duplicate of an MPI
// communicator (so its messages never match another channel's) and its own
// worker thread. Operations are started (MPI_I*) by the worker in the order
// they were submitted, which is the same order on every rank, and the worker
// polls all outstanding requests, so several operations can be in flight at
// once and a posted receive never blocks a later send. The submitting
// thread returns at once and goes on computing.
//
// Host memory only (the NCCL backend handles device memory). bf16 and f16
// reductions use a user-defined MPI_Op that adds in float.
//
// A request that does not complete within `timeout_s` fails with an
// ErrorKind::Comm error naming the group, the operation, its size and the
// timeout ("a peer rank may have died or stopped answering"); the channel is
// then broken and every later operation on it fails at once.
//
//   MpiCommunicator dp(sub_comm, "dp", {.timeout_s = 60});
//   WorkPtr w = dp.all_reduce_async(grads, ReduceOp::Sum);
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace xirang {

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `comm` (the caller keeps ownership of `comm`) and starts the worker thread.
  MpiCommunicator(MPI_Comm comm, std::string name, CommOptions opts);
  ~MpiCommunicator() override;  // drains outstanding operations, joins the worker, frees the duplicate

  int rank() const override;
  int size() const override;
  const std::string& name() const override;
  WorkPtr all_reduce_async(Tensor t, ReduceOp op) override;
  WorkPtr broadcast_async(Tensor t, int root) override;
  WorkPtr send_async(const Tensor& t, int peer, int tag) override;
  WorkPtr recv_async(Tensor t, int peer, int tag) override;
  void barrier() override;

  struct Impl;  // worker thread, queue, outstanding requests (comm/mpi_channel.h)

 protected:
  WorkPtr do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) override;
  WorkPtr do_all_gather(const Tensor& in, Tensor out) override;
  // One MPI_Ialltoallv, counts and displacements in elements of the dtype;
  // every count and displacement must fit MPI's int (checked).
  WorkPtr do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                          const std::vector<int64_t>& recv_counts, int64_t row) override;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace xirang
