// comm/communicator.h: the collective-communication interface the model and
// runtime talk to. A layer never calls MPI or NCCL directly; it is handed the
// Communicator of its group (its tensor-parallel group, say) by the runtime.
//
//   comm.all_reduce(grad, ReduceOp::Sum);   // count and dtype come from the view
//
// LocalCommunicator is the group of one rank: every collective is the
// identity, which is exactly right for a single-rank layout. The MPI and
// NCCL backends implement the same interface.
#pragma once

#include <memory>

#include "core/tensor.h"

namespace xirang {

enum class ReduceOp { Sum, Max };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over all ranks of the group.
  virtual void all_reduce(Tensor t, ReduceOp op) = 0;
  virtual void broadcast(Tensor t, int root) = 0;
  virtual void barrier() = 0;
};

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(Tensor, ReduceOp) override {}
  void broadcast(Tensor, int) override {}
  void barrier() override {}
};

}  // namespace xirang
