// tests/comm/completing_group.h: a communicator for tests that run without
// MPI. Every operation completes at once without touching data; the
// reduce_scatter, all_gather and all_to_all_v hooks (which the base class calls after its
// argument checks) are counted.
//
//   CompletingGroup g(/*rank=*/1, /*size=*/4, "rec4");
//   g.reduce_scatter(in, out, ReduceOp::Sum);   // checked by Communicator, then g.hook_calls == 1
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"

namespace xirang {

class CompletingGroup : public Communicator {
 public:
  CompletingGroup(int rank, int size, std::string name) : rank_(rank), size_(size), name_(std::move(name)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  WorkPtr all_reduce_async(Tensor, ReduceOp) override { return completed_work(); }
  WorkPtr broadcast_async(Tensor, int) override { return completed_work(); }
  WorkPtr send_async(const Tensor&, int, int) override { return completed_work(); }
  WorkPtr recv_async(Tensor, int, int) override { return completed_work(); }
  void barrier() override {}

  int hook_calls = 0;  // reduce_scatter, all_gather and all_to_all_v calls that passed the base class's checks

 protected:
  WorkPtr do_reduce_scatter(const Tensor&, Tensor, ReduceOp) override { return hook(); }
  WorkPtr do_all_gather(const Tensor&, Tensor) override { return hook(); }
  WorkPtr do_all_to_all_v(const Tensor&, const std::vector<int64_t>&, Tensor, const std::vector<int64_t>&,
                          int64_t) override {
    return hook();
  }

 private:
  WorkPtr hook() {
    ++hook_calls;
    return completed_work();
  }
  int rank_, size_;
  std::string name_;
};

}  // namespace xirang
