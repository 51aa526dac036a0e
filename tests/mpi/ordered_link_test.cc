// Tests of OrderedLink, the decorator that gives point-to-point operations
// NCCL's matching by order on top of MpiCommunicator: a shared order moves
// the data bit for bit, both ranks sending first deadlocks (and fails by the
// timeout, where plain MPI gets through on eager sends), differing orders or
// sizes fail both sides with one clear message, links with distinct tag bases
// are independent queues, collectives are the inner's, and sends to this
// rank itself are refused.
//
// The p2p tests run on pairs of world ranks ({0, 1}, {2, 3}); a rank left
// without a partner (np 3) skips. Every test makes a fresh inner
// communicator, so a message left behind by a failing case never reaches
// the next one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "comm/mpi_communicator.h"
#include "comm/ordered_link.h"
#include "core/clock.h"
#include "tests/mpi/mpi_test_util.h"

namespace xirang::test {
namespace {

// An inner communicator over this rank's pair, or null for a rank without a
// partner. Collective over the world: every rank calls it.
std::unique_ptr<MpiCommunicator> pair_inner(const char* name, double timeout_s) {
  int r = world_rank(), p = world_size();
  int color = 2 * (r / 2) + 1 < p ? r / 2 : MPI_UNDEFINED;
  MPI_Comm pair = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, color, r, &pair);
  if (pair == MPI_COMM_NULL) return nullptr;
  auto c = std::make_unique<MpiCommunicator>(pair, name, CommOptions{.timeout_s = timeout_s});
  MPI_Comm_free(&pair);
  return c;
}

std::string no_partner() {
  return str_cat("world rank ", world_rank(), " has no partner at np ", world_size(),
                 " (the p2p tests pair ranks {0, 1}, {2, 3})");
}

// b holds rank `rank`'s input for `seed`, compared as bytes.
void expect_bitwise_input_of(const Buf& b, uint64_t seed, int rank) {
  Buf want(b.dt, b.n);
  want.fill(seed, rank);
  size_t n = size_t(b.n) * dtype_size(b.dt);
  EXPECT_EQ(std::memcmp(b.bytes.data(), want.bytes.data(), n), 0)
      << dtype_name(b.dt) << "(" << b.n << ") differs from rank " << rank << "'s input for seed " << seed;
}

// The rank whose chunk (split_range) holds element i.
int owner_of(int64_t n, int p, int64_t i) {
  for (int q = 0; q < p; ++q) {
    auto [b, e] = split_range(n, p, q);
    if (i >= b && i < e) return q;
  }
  return -1;
}

void expect_poisoned(const Buf& b) {
  Buf want(b.dt, b.n);
  want.poison();
  EXPECT_EQ(std::memcmp(b.bytes.data(), want.bytes.data(), size_t(b.n) * dtype_size(b.dt)), 0)
      << "the receive buffer was written although no data should have moved";
}

// Rank 0 sends then receives, rank 1 receives then sends: the order both
// sides share, so it runs on NCCL too. Everything is submitted before the
// first wait, so the link's queue (not the caller) keeps the order. A send
// of 0 bytes that nobody receives takes no place in the order, as on NCCL.
TEST(OrderedLink, SharedOrderMovesTheDataBitwise) {
  auto inner = pair_inner("pp", 5);
  if (!inner) GTEST_SKIP() << no_partner();
  OrderedLink link(*inner, "pp", 1000, 3);
  int r = link.rank(), peer = 1 - r;
  ASSERT_EQ(link.size(), 2);
  EXPECT_EQ(link.name(), "pp");
  uint64_t seed = 70;
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t n : {1, 7, 4099, 100003}) {
      SCOPED_TRACE(str_cat(dtype_name(dt), " n=", n));
      Buf fwd(dt, n), bwd(dt, n + 3);  // forward activations, backward gradients of another size
      if (r == 0) {
        fwd.fill(seed, 0);
        bwd.poison();
      } else {
        fwd.poison();
        bwd.fill(seed + 1, 1);
      }
      Buf nothing(dt, 0);
      EXPECT_TRUE(link.send_async(nothing.t(), peer, 99)->test());
      WorkPtr first, second;
      if (r == 0) {
        first = link.send_async(fwd.t(), 1, 1);
        second = link.recv_async(bwd.t(), 1, 2);
      } else {
        first = link.recv_async(fwd.t(), 0, 1);
        second = link.send_async(bwd.t(), 0, 2);
      }
      second->wait();
      EXPECT_TRUE(first->test());  // the queue ran it before the second
      first->wait();
      EXPECT_GT(second->duration_ms(), 0.0);
      if (r == 0) expect_bitwise_input_of(bwd, seed + 1, 1);
      else expect_bitwise_input_of(fwd, seed, 0);
      seed += 2;
    }
  EXPECT_FALSE(link.broken());
}

// Both ranks send first, then receive. Plain MPI gets through on eager
// sends; on the ordered link each send waits for the peer's matching recv to
// reach the head of the peer's queue, which never happens: both waits fail by
// the 1 s timeout, the link is broken, and its destructor returns at once.
// (The inner times out the abandoned handshake after 2 s by itself.)
TEST(OrderedLink, BothRanksSendingFirstDeadlockAndTimeOut) {
  auto inner = pair_inner("pp", 2);
  if (!inner) GTEST_SKIP() << no_partner();
  int r = inner->rank(), peer = 1 - r;
  Buf out(DType::F32, 256), in(DType::F32, 256);
  out.fill(80, r);
  in.poison();
  {
    WorkPtr s = inner->send_async(out.t(), peer, 10 + r);
    WorkPtr v = inner->recv_async(in.t(), peer, 10 + peer);
    s->wait();
    v->wait();
    expect_bitwise_input_of(in, 80, peer);
  }
  in.poison();
  Stopwatch sw;
  double destroyed = 0;
  {
    OrderedLink link(*inner, "pp", 1000, 1);
    WorkPtr s = link.send_async(out.t(), peer, 10 + r);
    WorkPtr v = link.recv_async(in.t(), peer, 10 + peer);
    expect_error([&] { s->wait(); }, ErrorKind::Comm,
                 {str_cat("pp send of 1024 bytes to rank ", peer, " with tag ", 10 + r, " did not complete within 1 s"),
                  "with order-matched sends and receives, two ranks whose queues wait on each other deadlock",
                  str_cat("(this is rank ", r, " of 2 on ordered link pp)")});
    double waited = sw.seconds();
    EXPECT_GE(waited, 0.9);
    EXPECT_LE(waited, 3.0);
    expect_error([&] { v->wait(); }, ErrorKind::Comm, {"pp recv of 1024 bytes", "did not complete within 1 s"});
    EXPECT_TRUE(s->test());
    EXPECT_TRUE(v->test());
    EXPECT_TRUE(link.broken());
    sw.restart();
    WorkPtr later = link.send_async(out.t(), peer, 3);
    EXPECT_TRUE(later->test());
    expect_error([&] { later->wait(); }, ErrorKind::Comm,
                 {"pp send of 1024 bytes to rank ", "refused: link pp is broken", "did not complete within 1 s"});
    expect_error([&] { link.barrier(); }, ErrorKind::Comm, {"pp barrier refused"});
    EXPECT_LT(sw.seconds(), 0.5);
    sw.restart();
  }
  destroyed = sw.seconds();
  EXPECT_LT(destroyed, 0.5) << "destroying a broken link must not wait";
  expect_poisoned(in);
}

// A link destroyed with an operation that can never complete (rank 1 never
// posts the matching send) gives up by that operation's deadline.
TEST(OrderedLink, DestructorGivesUpOnAnUnmatchedOperationByItsDeadline) {
  auto inner = pair_inner("pp", 2);
  if (!inner) GTEST_SKIP() << no_partner();
  Buf in(DType::F32, 64);
  in.poison();
  WorkPtr orphan;
  Stopwatch sw;
  {
    OrderedLink link(*inner, "pp", 1000, 1);
    if (link.rank() == 0) orphan = link.recv_async(in.t(), 1, 4);
  }
  if (inner->rank() == 0) {
    EXPECT_GE(sw.seconds(), 0.9);
    EXPECT_LE(sw.seconds(), 2.5);
    ASSERT_TRUE(orphan->test());
    expect_error([&] { orphan->wait(); }, ErrorKind::Comm,
                 {"pp recv of 256 bytes from rank 1 with tag 4", "within 1 s"});
  }
}

// Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first. By order the
// first send meets the first recv: both sides fail at once, naming both
// tags, and no data moves. A second link on the same inner then disagrees on
// the size of one message.
TEST(OrderedLink, DifferentOrdersOrSizesFailBothSides) {
  auto inner = pair_inner("pp", 5);
  if (!inner) GTEST_SKIP() << no_partner();
  int r = inner->rank();
  Buf x1(DType::F32, 100), x2(DType::F32, 100);
  if (r == 0) {
    x1.fill(1, 0);
    x2.fill(2, 0);
  } else {
    x1.poison();
    x2.poison();
  }
  Stopwatch sw;
  {
    OrderedLink link(*inner, "pp_grads", 1000, 10);
    const char* why = "this link matches sends and receives by order, as NCCL does, and the two ranks' orders differ";
    if (r == 0) {
      WorkPtr a = link.send_async(x1.t(), 1, 1);
      WorkPtr b = link.send_async(x2.t(), 1, 2);
      expect_error([&] { a->wait(); }, ErrorKind::Comm,
                   {"pp_grads send to rank 1 (tag 1, 400 bytes) met the peer's recv (tag 2, 400 bytes)", why,
                    "(this is rank 0 of 2 on ordered link pp_grads)"});
      expect_error([&] { b->wait(); }, ErrorKind::Comm,
                   {"pp_grads send of 400 bytes to rank 1 with tag 2 refused", "met the peer's recv (tag 2"});
    } else {
      WorkPtr b = link.recv_async(x2.t(), 0, 2);
      WorkPtr a = link.recv_async(x1.t(), 0, 1);
      expect_error([&] { b->wait(); }, ErrorKind::Comm,
                   {"pp_grads recv from rank 0 (tag 2, 400 bytes) met the peer's send (tag 1, 400 bytes)", why,
                    "(this is rank 1 of 2 on ordered link pp_grads)"});
      expect_error([&] { a->wait(); }, ErrorKind::Comm, {"pp_grads recv of 400 bytes from rank 0 with tag 1 refused"});
      expect_poisoned(x1);
      expect_poisoned(x2);
    }
    EXPECT_TRUE(link.broken());
  }
  {
    OrderedLink link(*inner, "pp", 2000, 10);
    Buf small(DType::I32, 10), large(DType::I32, 11);
    small.fill(3, r);
    const char* why = "the two sides disagree on the message size";
    if (r == 0)
      expect_error([&] { link.send(small.t(), 1, 5); }, ErrorKind::Comm,
                   {"pp send to rank 1 (tag 5, 40 bytes) met the peer's recv (tag 5, 44 bytes)", why});
    else
      expect_error([&] { link.recv(large.t(), 0, 5); }, ErrorKind::Comm,
                   {"pp recv from rank 0 (tag 5, 44 bytes) met the peer's send (tag 5, 40 bytes)", why});
  }
  // 10 s timeouts leave a loaded machine a wide margin between "at once" and "by the timeout".
  EXPECT_LT(sw.seconds(), 5.0) << "a mismatch fails at once, not by the timeout";
  // Mismatches move no data, so the inner is still in step.
  EXPECT_EQ(inner->all_reduce_sum(1.0), 2.0);
}

// Rank 0 sends on link B, then on link A; rank 1 receives on A (waiting for
// it) and only then on B. On one queue rank 0's send for B would sit at the
// head meeting rank 1's recv for A; links with their own tag bases are
// separate queues, like two NCCL channels, so both messages arrive.
TEST(OrderedLink, LinksWithDistinctTagBasesAreIndependentQueues) {
  auto inner = pair_inner("pp", 5);
  if (!inner) GTEST_SKIP() << no_partner();
  OrderedLink a(*inner, "pp_a", 100, 3), b(*inner, "pp_b", 200, 3);
  int r = inner->rank();
  Buf xa(DType::F32, 1000), xb(DType::BF16, 333);
  if (r == 0) {
    xa.fill(11, 0);
    xb.fill(12, 0);
    WorkPtr sb = b.send_async(xb.t(), 1, 7);
    WorkPtr sa = a.send_async(xa.t(), 1, 7);
    sa->wait();
    sb->wait();
  } else {
    xa.poison();
    xb.poison();
    a.recv(xa.t(), 0, 7);
    expect_poisoned(xb);
    b.recv(xb.t(), 0, 7);
    expect_bitwise_input_of(xa, 11, 0);
    expect_bitwise_input_of(xb, 12, 0);
  }
  EXPECT_FALSE(a.broken());
  EXPECT_FALSE(b.broken());
}

// Collectives through the link are the inner's, over the whole world, in
// queue order: submitted together and waited in reverse, each gives what the
// inner communicator gives on the same input.
TEST(OrderedLink, CollectivesAreTheInners) {
  MpiCommunicator inner(MPI_COMM_WORLD, "world", kOpts);
  OrderedLink link(inner, "world", 0, 3);
  int p = link.size(), r = link.rank();
  EXPECT_EQ(p, world_size());
  for (DType dt : {DType::F32, DType::I32}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t n = 1001;
    Buf sum(dt, n), ref(dt, n), bc(dt, 17), gathered(dt, n);
    sum.fill(40, r);
    ref.fill(40, r);
    bc.fill(41, r);
    auto [b, e] = split_range(n, p, r);
    gathered.poison();
    gathered.fill(42, r, b, e);
    WorkPtr w1 = link.all_reduce_async(sum.t(), ReduceOp::Sum);
    WorkPtr w2 = link.broadcast_async(bc.t(), p - 1);
    WorkPtr w3 = link.all_gather_async(gathered.range(b, e), gathered.t());
    w3->wait();
    EXPECT_TRUE(w1->test());
    EXPECT_TRUE(w2->test());
    w2->wait();
    w1->wait();
    inner.all_reduce(ref.t(), ReduceOp::Sum);
    EXPECT_EQ(std::memcmp(sum.bytes.data(), ref.bytes.data(), size_t(n) * dtype_size(dt)), 0);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      double want = 0, abs_sum = 0;
      for (int q = 0; q < p; ++q) want += input_value(dt, 40, q, i), abs_sum += std::abs(input_value(dt, 40, q, i));
      bad += std::abs(sum.get(i) - want) > sum_tolerance(dt, p, abs_sum);
      bad += gathered.get(i) != input_value(dt, 42, owner_of(n, p, i), i);
    }
    EXPECT_EQ(bad, 0);
    expect_bitwise_input_of(bc, 41, p - 1);
  }
  link.barrier();
  EXPECT_EQ(link.all_reduce_sum(1.0), p);
  EXPECT_FALSE(link.broken());
}

// A send or recv to this rank itself would wait forever on NCCL; the link
// refuses it (and other bad arguments) at submission and keeps working.
TEST(OrderedLink, SendToThisRankIsRefused) {
  MpiCommunicator inner(MPI_COMM_WORLD, "world", kOpts);
  OrderedLink link(inner, "pp", 1000, 3);
  int r = link.rank(), p = link.size();
  Buf x(DType::F32, 4);
  x.fill(50, r);
  expect_error([&] { link.send_async(x.t(), r, 0); }, ErrorKind::Comm,
               {str_cat("pp send of 16 bytes to rank ", r, " with tag 0"), "to this rank itself would wait forever"});
  expect_error([&] { link.recv_async(x.t(), r, 0); }, ErrorKind::Comm,
               {str_cat("pp recv of 16 bytes from rank ", r), "this rank itself"});
  expect_error([&] { link.send_async(x.t(), p, 0); }, ErrorKind::Comm, {"pp send", "peer must be a rank in [0, "});
  expect_error([&] { link.recv_async(x.t(), (r + 1) % p, -1); }, ErrorKind::Comm,
               {"pp recv", "tag must be non-negative"});
  Tensor on_gpu(x.bytes.data(), {4}, DType::F32, Device::CUDA);
  expect_error([&] { link.all_reduce_async(on_gpu, ReduceOp::Sum); }, ErrorKind::Comm,
               {"pp all_reduce of 16 bytes", "not in host memory"});
  expect_error([] { MpiCommunicator c(MPI_COMM_SELF, "solo", kOpts); OrderedLink l(c, "solo", -1, 1); },
               ErrorKind::Config, {"ordered link solo", "tag_base -1"});
  expect_error([] { MpiCommunicator c(MPI_COMM_SELF, "solo", kOpts); OrderedLink l(c, "solo", 0, 0); },
               ErrorKind::Config, {"ordered link solo", "timeout_s must be > 0"});
  EXPECT_FALSE(link.broken());
  EXPECT_EQ(link.all_reduce_sum(2.0), 2.0 * p);
}

}  // namespace
}  // namespace xirang::test
