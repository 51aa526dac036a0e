// comm/ordered_link.h: a Communicator decorator that gives point-to-point
// operations NCCL's matching semantics on top of a host communicator (MPI),
// so that the order of a pipeline's sends and receives can be tested for
// deadlocks and mismatches on a machine without GPUs.
//
// MPI matches a send with a receive by (peer, tag) and buffers small sends,
// so an exchange in the wrong order usually works there and then hangs or
// delivers the wrong activation on NCCL. This link behaves like one NCCL
// channel (comm/nccl_communicator.h, "Differences from the MPI backend"):
// - Every operation runs on the link's single worker thread, one at a time,
//   in submission order (NCCL: one stream).
// - A send is matched with the peer's recv by ORDER: the k-th send to a peer
//   meets the peer's k-th recv from this rank. Tags and sizes are not used
//   to match; they are compared, and a difference fails both sides.
// - Rendezvous: a send holds the queue until the peer's matching recv is at
//   the head of the peer's queue; a recv holds it until the data arrived.
// So two ranks that each send first and then receive from each other
// deadlock (wait() fails after timeout_s), and two ranks whose send/recv
// orders differ fail with a message naming both sides' tags and sizes.
//
// Protocol, run by the worker when a p2p operation reaches the head of the
// queue; every step is an operation on the inner communicator, on tags
// tag_base + 0 (ready), + 1 (status) and + 2 (data):
//   recv(t, peer, tag): send "ready" {tag, bytes} to the peer; receive its
//       status {ok, tag, bytes}; if ok, receive the data into t.
//   send(t, peer, tag): receive the peer's ready (this is the rendezvous);
//       compare {tag, bytes} with its own and send the status; if they
//       match, send t.
// A send or recv of 0 bytes completes at once without a handshake, as on
// NCCL, where it is a no-op that takes no place in the order.
// Collectives (and barrier, a one-element all-reduce) are the inner's,
// started when they reach the head of the queue. Collectives are matched by
// order on the inner communicator, so two links over one inner must not both
// issue collectives (their workers would interleave them differently on
// different ranks); p2p traffic of several links over one inner is fine.
//
// Failures: every error is an ErrorKind::Comm error that wait() rethrows.
// An operation not finished timeout_s after its submission (queueing
// included) fails with a message saying it did not complete in time and
// why that usually happens here (two queues waiting on each other). After
// any failure the link is broken: queued and later operations fail at once,
// naming the first failure. Arguments the link itself refuses (a peer out of
// range or this rank itself, a device tensor) throw from the *_async call
// and leave the link working. Errors of the inner communicator fail the
// operation and break the link.
//
// When the link gives up on an inner operation (timeout or break), that
// operation stays posted on the inner communicator, which finishes or times
// it out on its own; until then it may still read or write the caller's
// tensor, as with a timed-out MpiCommunicator operation. After a deadlock
// the inner communicator should therefore be discarded (tests make a fresh
// one per case) and its own timeout bounds its destruction.
//
//   MpiCommunicator mpi(pair_comm, "pp", {.timeout_s = 5});
//   OrderedLink pp(mpi, "pp", /*tag_base=*/1000, /*timeout_s=*/2);
//   if (pp.rank() == 0) { pp.send(x, 1, 7); pp.recv(g, 1, 8); }
//   else                { pp.recv(x, 0, 7); pp.send(g, 0, 8); }   // same order: works
//   // both ranks send first: each wait() fails after 2 s ("... deadlock")
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace xirang {

class OrderedLink final : public Communicator {
 public:
  // `inner` (not owned) carries the messages and must outlive the link. The
  // link's own messages use tags [tag_base, tag_base + 3) on `inner`: links
  // sharing one inner communicator need distinct bases, and the caller's own
  // traffic on `inner` must avoid them. timeout_s > 0 bounds every operation
  // from its submission.
  OrderedLink(Communicator& inner, std::string name, int tag_base, double timeout_s);
  // Lets the worker finish the queue (each operation completes, fails at once
  // on a broken link, or times out by its deadline) and joins it: returns
  // within about timeout_s of the last submission, never hangs.
  ~OrderedLink() override;

  int rank() const override;
  int size() const override;
  const std::string& name() const override;
  // Every operation below (and reduce-scatter and all-gather) is queued on
  // the link's worker thread and runs to completion in submission order.
  WorkPtr all_reduce_async(Tensor t, ReduceOp op) override;
  WorkPtr broadcast_async(Tensor t, int root) override;
  WorkPtr send_async(const Tensor& t, int peer, int tag) override;
  WorkPtr recv_async(Tensor t, int peer, int tag) override;
  void barrier() override;

  // True once an operation failed; every later one then fails at once.
  bool broken() const;

  struct Impl;  // worker thread, queue, broken state (ordered_link.cc)

 protected:
  WorkPtr do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) override;
  WorkPtr do_all_gather(const Tensor& in, Tensor out) override;
  // The inner's all-to-all-v, queued like the other collectives.
  WorkPtr do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                          const std::vector<int64_t>& recv_counts, int64_t row) override;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace xirang
