// Tests of MpiCommunicator's point-to-point operations, its argument checks
// and its failure path: a timed-out operation breaks the channel, later
// operations fail at once, and the broken communicator still destructs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "comm/mpi_communicator.h"
#include "core/clock.h"
#include "tests/mpi/mpi_test_util.h"

namespace xirang::test {
namespace {

void expect_input_of(const Buf& b, uint64_t seed, int rank) {
  int64_t bad = 0;
  for (int64_t i = 0; i < b.n; ++i) bad += b.get(i) != input_value(b.dt, seed, rank, i);
  EXPECT_EQ(bad, 0) << "elements of " << dtype_name(b.dt) << "(" << b.n << ") differ from rank " << rank << "'s input";
}

TEST(MpiP2p, RingEveryDtype) {
  MpiCommunicator c(MPI_COMM_WORLD, "pp", kOpts);
  int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  uint64_t seed = 500;
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::U16, DType::U32})
    for (int64_t n : {1, 7, 100003}) {
      SCOPED_TRACE(str_cat("ring ", dtype_name(dt), " n=", n));
      Buf out(dt, n), in(dt, n);
      out.fill(seed, r);
      in.poison();
      WorkPtr rv = c.recv_async(in.t(), prev, int(seed % 1000));
      WorkPtr sd = c.send_async(out.t(), next, int(seed % 1000));
      sd->wait();
      rv->wait();
      expect_input_of(in, seed, prev);
      ++seed;
    }
}

// Two messages to the same peer at once, told apart by their tags, received
// in the opposite order from the one they were sent in.
TEST(MpiP2p, ConcurrentMessagesMatchByTag) {
  MpiCommunicator c(MPI_COMM_WORLD, "pp", kOpts);
  int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  Buf a(DType::F32, 1001), b(DType::F32, 17), ga(DType::F32, 1001), gb(DType::F32, 17);
  a.fill(1, r);
  b.fill(2, r);
  ga.poison();
  gb.poison();
  WorkPtr sa = c.send_async(a.t(), next, 11);
  WorkPtr sb = c.send_async(b.t(), next, 12);
  WorkPtr rb = c.recv_async(gb.t(), prev, 12);
  WorkPtr ra = c.recv_async(ga.t(), prev, 11);
  rb->wait();
  ra->wait();
  sb->wait();
  sa->wait();
  expect_input_of(ga, 1, prev);
  expect_input_of(gb, 2, prev);
}

// The receive is started before the barrier (same channel, so in order) and
// the send only after it, late: the pending receive must not block the
// barrier, and its duration counts from its own start.
TEST(MpiP2p, ReceivePostedBeforeTheSend) {
  MpiCommunicator c(MPI_COMM_WORLD, "pp", kOpts);
  int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  Buf out(DType::F64, 333), in(DType::F64, 333);
  out.fill(9, r);
  in.poison();
  WorkPtr rv = c.recv_async(in.t(), prev, 3);
  c.barrier();
  EXPECT_FALSE(rv->test());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  c.send(out.t(), next, 3);
  rv->wait();
  EXPECT_GE(rv->duration_ms(), 90.0);
  expect_input_of(in, 9, prev);
}

TEST(MpiP2p, MessageOfTheWrongSizeFailsWithoutBreakingTheChannel) {
  MpiCommunicator c(MPI_COMM_WORLD, "pp", kOpts);
  int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  Buf out(DType::I32, 5), shorter(DType::I32, 7), longer(DType::I32, 3);
  out.fill(1, r);
  WorkPtr rv = c.recv_async(shorter.t(), prev, 1);
  c.send(out.t(), next, 1);
  expect_error([&] { rv->wait(); }, ErrorKind::Comm, {"pp recv of 28 bytes from rank", "received 5 elements but expected 7"});
  rv = c.recv_async(longer.t(), prev, 2);
  c.send(out.t(), next, 2);
  expect_error([&] { rv->wait(); }, ErrorKind::Comm, {"pp recv of 12 bytes", "failed"});
  c.barrier();
  EXPECT_EQ(c.all_reduce_sum(1.0), p);
}

TEST(MpiP2p, BadArgumentsAreCommErrorsNamingTheOp) {
  MpiCommunicator c(MPI_COMM_WORLD, "shapes", kOpts);
  int p = c.size();
  const int64_t n = 10;
  auto [b, e] = split_range(n, p, c.rank());
  Buf in(DType::F32, n), wrong(DType::F32, n + 1), chunk16(DType::F16, e - b);
  expect_error([&] { c.reduce_scatter(in.t(), wrong.t(), ReduceOp::Sum); }, ErrorKind::Comm,
               {"shapes reduce_scatter of 40 bytes", "this rank's chunk", str_cat(e - b, " elements")});
  expect_error([&] { c.all_gather(wrong.t(), in.t()); }, ErrorKind::Comm,
               {"shapes all_gather of 40 bytes", "this rank's chunk"});
  expect_error([&] { c.reduce_scatter(in.t(), chunk16.t(), ReduceOp::Sum); }, ErrorKind::Comm,
               {"shapes reduce_scatter", "different dtypes"});
  expect_error([&] { c.all_gather(chunk16.t(), in.t()); }, ErrorKind::Comm, {"shapes all_gather", "different dtypes"});
  // Overlapping but not this rank's chunk (1 is no chunk start for n = 10 and 2, 3 or 4 ranks).
  expect_error([&] { c.reduce_scatter(in.t(), in.range(1, 1 + e - b), ReduceOp::Sum); }, ErrorKind::Comm,
               {"shapes reduce_scatter", "overlaps"});
  expect_error([&] { c.broadcast(in.t(), p); }, ErrorKind::Comm, {"shapes broadcast", "root must be in [0, "});
  expect_error([&] { c.send(in.t(), p, 0); }, ErrorKind::Comm, {"shapes send", "peer must be"});
  expect_error([&] { c.recv(in.t(), -1, 0); }, ErrorKind::Comm, {"shapes recv", "peer must be"});
  expect_error([&] { c.recv(in.t(), 0, -1); }, ErrorKind::Comm, {"shapes recv", "tag must be"});
  Tensor on_gpu(in.bytes.data(), {n}, DType::F32, Device::CUDA);
  expect_error([&] { c.all_reduce(on_gpu, ReduceOp::Sum); }, ErrorKind::Comm, {"shapes all_reduce", "host memory"});
  // Refused arguments never reach MPI, so the channel still works.
  EXPECT_EQ(c.all_reduce_sum(2.0), 2.0 * p);
}

// Rank 0 waits for a message rank 1 never sends. The receive fails after
// the 1 s timeout, the channel is broken from then on, and everyone carries
// on with a fresh communicator.
TEST(MpiTimeout, ReceiveThatNeverMatchesBreaksTheChannel) {
  {
    MpiCommunicator c(MPI_COMM_WORLD, "flaky", CommOptions{.timeout_s = 1});
    if (c.rank() == 0) {
      Buf never(DType::F32, 256), x(DType::F32, 4);
      Stopwatch sw;
      WorkPtr w = c.recv_async(never.t(), 1, 99);
      expect_error([&] { w->wait(); }, ErrorKind::Comm,
                   {"flaky recv of 1024 bytes from rank 1 with tag 99 did not complete within 1 s",
                    "a peer rank may have died or stopped answering", "(this is rank 0 of ", "in group flaky)"});
      double waited = sw.seconds();
      EXPECT_GE(waited, 0.9);
      EXPECT_LE(waited, 3.0);
      EXPECT_TRUE(w->test());
      sw.restart();
      WorkPtr later = c.all_reduce_async(x.t(), ReduceOp::Sum);
      expect_error([&] { later->wait(); }, ErrorKind::Comm, {"flaky all_reduce of 16 bytes refused", "broken"});
      expect_error([&] { c.barrier(); }, ErrorKind::Comm, {"flaky barrier refused"});
      expect_error([&] { c.send(x.t(), 1, 1); }, ErrorKind::Comm, {"flaky send", "refused"});
      EXPECT_LT(sw.seconds(), 0.5);
    }
  }  // rank 0 destroys a broken communicator here: it must neither hang nor crash
  MpiCommunicator fresh(MPI_COMM_WORLD, "fresh", kOpts);
  EXPECT_EQ(fresh.all_reduce_sum(1.0), fresh.size());
}

// Rank 0 gives up on a collective its peers join only after its 1 s timeout
// (a peer that stalled). Collectives cannot be cancelled, so rank 0's request
// is abandoned but stays alive inside MPI: the late peers still complete
// against it, which leaves no stray message behind for later tests.
TEST(MpiTimeout, CollectiveThatPeersJoinTooLateTimesOut) {
  int p = world_size();
  Buf x(DType::F32, 1 << 18), y(DType::F64, 3);  // outlive the abandoned request
  x.fill(1, world_rank());
  y.fill(2, world_rank());
  {
    MpiCommunicator c(MPI_COMM_WORLD, "dp", CommOptions{.timeout_s = world_rank() == 0 ? 1.0 : 30.0});
    if (c.rank() == 0) {
      Stopwatch sw;
      WorkPtr a = c.all_reduce_async(x.t(), ReduceOp::Sum);
      WorkPtr b = c.all_reduce_async(y.t(), ReduceOp::Max);
      expect_error([&] { a->wait(); }, ErrorKind::Comm,
                   {"dp all_reduce of 1048576 bytes did not complete within 1 s: a peer rank may have died or "
                    "stopped answering (this is rank 0 of "});
      expect_error([&] { b->wait(); }, ErrorKind::Comm, {"dp all_reduce of 24 bytes", "did not complete within 1 s"});
      EXPECT_LE(sw.seconds(), 3.0);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      c.all_reduce(x.t(), ReduceOp::Sum);
      c.all_reduce(y.t(), ReduceOp::Max);
      double want = 0;
      for (int r = 0; r < p; ++r) want = std::max(want, input_value(DType::F64, 2, r, 1));
      EXPECT_EQ(y.get(1), want);
    }
  }
  MpiCommunicator fresh(MPI_COMM_WORLD, "fresh", kOpts);
  fresh.barrier();
  EXPECT_EQ(fresh.all_reduce_sum(1.0), p);
}

}  // namespace
}  // namespace xirang::test
