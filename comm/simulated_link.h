// comm/simulated_link.h: a Communicator decorator that makes a link slower
// and less reliable than the machine it runs on.
//
// Tests and benchmarks on one machine use it to show that overlap hides a
// slow network and that faults end a job cleanly. The wrapped communicator
// does the real transfer; the decorator then holds each operation's
// completion back until the time a link of the given latency and bandwidth
// would have needed. The link is one serial resource per decorator: an
// operation starts when it is submitted or when the previous one finishes,
// whichever is later, and takes
//     latency_us + bytes_on_the_wire / bandwidth
// where bytes_on_the_wire is what a ring algorithm sends per rank:
// 2 (n-1)/n x size for all-reduce, (n-1)/n x size for reduce-scatter and
// all-gather, the size for broadcast, send and recv, and for all-to-all-v
// the larger of the bytes this rank sends to and receives from other ranks
// (a full-duplex link; the rows to itself never leave the rank).
//
// Faults: fail_next(k) makes the k-th operation from now fail with an
// ErrorKind::Comm error ("injected transfer failure"); stall_next(k) makes it
// never complete, so wait() fails after timeout_s like a peer that stopped
// answering.
//
//   SimulatedLink link(std::move(mpi_dp), LinkModel{.latency_us = 50, .bandwidth_gbps = 1}, 60.0);
//   link.all_reduce_async(bucket, ReduceOp::Sum)->wait();   // takes at least 50 us + transfer time
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace xirang {

struct LinkModel {
  double latency_us = 0;      // added to every operation
  double bandwidth_gbps = 0;  // gigabytes per second; 0 means no limit
  bool active() const { return latency_us > 0 || bandwidth_gbps > 0; }
};

class SimulatedLink final : public Communicator {
 public:
  SimulatedLink(std::unique_ptr<Communicator> inner, LinkModel link, double timeout_s);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  WorkPtr all_reduce_async(Tensor t, ReduceOp op) override;
  WorkPtr broadcast_async(Tensor t, int root) override;
  WorkPtr send_async(const Tensor& t, int peer, int tag) override;
  WorkPtr recv_async(Tensor t, int peer, int tag) override;
  void barrier() override { inner_->barrier(); }

  void fail_next(int k = 1);
  void stall_next(int k = 1);
  // Seconds the modelled link needs for `bytes` on the wire.
  double transfer_seconds(double wire_bytes) const;

 protected:
  WorkPtr do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) override;
  WorkPtr do_all_gather(const Tensor& in, Tensor out) override;
  WorkPtr do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                          const std::vector<int64_t>& recv_counts, int64_t row) override;

 private:
  WorkPtr wrap(WorkPtr inner, double wire_bytes, const char* op);

  std::unique_ptr<Communicator> inner_;
  LinkModel link_;
  double timeout_s_;
  std::mutex mu_;
  double link_free_at_ = 0;  // steady-clock seconds when the modelled link is idle again
  int fail_countdown_ = 0;
  int stall_countdown_ = 0;
};

}  // namespace xirang
