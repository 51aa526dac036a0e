// Tests for comm/simulated_link.h: the modelled latency and bandwidth, link
// serialization, overlap with compute, fault injection, and that data still
// flows through the wrapped communicator. No MPI: LocalCommunicator (whose
// collectives complete at once) or a fake group of four stands underneath,
// so every delay measured here is the decorator's. Timing bounds are tight
// below (the model promises "not before") and loose above (shared machine);
// "at once" is checked as "not yet delivered" (test() false) where it can
// be, and ctest runs these tests serially (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/simulated_link.h"
#include "tests/comm/completing_group.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace xirang {
namespace {

constexpr double kSlack = 5.0;  // upper bounds: generous multiple of the modelled time

std::vector<float> random_values(int64_t n, uint64_t stream) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float(rng_normal(7, stream, uint64_t(i)));
  return v;
}

Tensor view(std::vector<float>& v) { return Tensor(v.data(), {int64_t(v.size())}, DType::F32); }

SimulatedLink local_link(LinkModel model, double timeout_s = 60, const std::string& name = "dp") {
  return SimulatedLink(std::make_unique<LocalCommunicator>(name), model, timeout_s);
}

// Keeps the core busy for `ms` of wall time, standing in for a backward pass.
double busy_compute(double ms) {
  Stopwatch sw;
  double acc = 0;
  uint64_t i = 0;
  while (sw.ms() < ms)
    for (int j = 0; j < 1000; ++j, ++i) acc += std::sqrt(double(i));
  return acc;
}

void expect_comm_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Comm) << e.what();
    for (auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

TEST(SimulatedLink, TransferSecondsIsBytesOverBandwidth) {
  EXPECT_DOUBLE_EQ(local_link({.latency_us = 0, .bandwidth_gbps = 2}).transfer_seconds(4e9), 2.0);
  EXPECT_DOUBLE_EQ(local_link({.latency_us = 0, .bandwidth_gbps = 0.1}).transfer_seconds(4e6), 0.04);
  EXPECT_DOUBLE_EQ(local_link({.latency_us = 5, .bandwidth_gbps = 0}).transfer_seconds(1e12), 0.0);  // no limit
}

TEST(SimulatedLink, LatencyDelaysWaitButNotSubmission) {
  auto link = local_link({.latency_us = 20000});
  auto x = random_values(1000, 1);
  Stopwatch sw;
  WorkPtr w = link.all_reduce_async(view(x), ReduceOp::Sum);
  EXPECT_FALSE(w->test());  // submission returned before the modelled delivery: the caller is free to compute
  w->wait();
  EXPECT_GE(sw.ms(), 20.0);
  EXPECT_LT(sw.ms(), 20.0 * kSlack);
}

// A host communicator has no device stream to hand the join to: join() is a
// wait (the tensor-parallel layers call join() on every backend).
TEST(SimulatedLink, JoinOnTheHostWaitsLikeWait) {
  auto link = local_link({.latency_us = 20000});
  auto x = random_values(1000, 2);
  Stopwatch sw;
  WorkPtr w = link.all_reduce_async(view(x), ReduceOp::Sum);
  w->join(nullptr);
  EXPECT_GE(sw.ms(), 20.0);
  EXPECT_TRUE(w->test());
}

TEST(SimulatedLink, BandwidthLimitsAndOperationsSerialize) {
  auto link = local_link({.latency_us = 0, .bandwidth_gbps = 0.1});
  auto x = random_values(1'000'000, 2);  // 4 MB: 40 ms at 0.1 GB/s
  auto y = random_values(1'000'000, 3);
  {
    Stopwatch sw;
    link.broadcast(view(x), 0);
    EXPECT_GE(sw.ms(), 40.0);
    EXPECT_LT(sw.ms(), 40.0 * kSlack);
  }
  Stopwatch sw;
  WorkPtr a = link.broadcast_async(view(x), 0);
  WorkPtr b = link.broadcast_async(view(y), 0);
  EXPECT_FALSE(a->test());  // neither submission waited for its transfer
  b->wait();  // queued behind a on the one link
  EXPECT_GE(sw.ms(), 80.0);
  EXPECT_LT(sw.ms(), 80.0 * kSlack);
  EXPECT_TRUE(a->test());
}

TEST(SimulatedLink, ComputeHidesTheTransfer) {
  auto link = local_link({.latency_us = 50000});
  auto x = random_values(1000, 4);
  {
    WorkPtr w = link.all_reduce_async(view(x), ReduceOp::Sum);
    busy_compute(60);
    EXPECT_TRUE(w->test());  // delivered during the compute: waiting costs nothing
    Stopwatch exposed;
    w->wait();
    EXPECT_LT(exposed.ms(), 15.0);
  }
  WorkPtr w = link.all_reduce_async(view(x), ReduceOp::Sum);
  Stopwatch exposed;
  w->wait();
  EXPECT_GE(exposed.ms(), 45.0);
}

TEST(SimulatedLink, TestTurnsTrueAtTheModelledTime) {
  auto link = local_link({.latency_us = 100000});
  auto x = random_values(1000, 5);
  Stopwatch sw;
  WorkPtr w = link.all_reduce_async(view(x), ReduceOp::Sum);
  EXPECT_FALSE(w->test());
  while (!w->test() && sw.ms() < 100.0 * kSlack) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const double first_true_ms = sw.ms();
  EXPECT_TRUE(w->test());
  EXPECT_GE(first_true_ms, 100.0);
  EXPECT_LT(first_true_ms, 100.0 * kSlack);
  w->wait();
  EXPECT_TRUE(w->test());
}

TEST(SimulatedLink, DurationRunsFromSubmissionToDelivery) {
  // 10 ms latency + 4 MB at 0.2 GB/s (20 ms) = 30 ms each; the second
  // operation queues 30 ms behind the first, so it is delivered 60 ms after
  // its submission, and submission + duration is its completion time.
  auto link = local_link({.latency_us = 10000, .bandwidth_gbps = 0.2});
  auto x = random_values(1'000'000, 6);
  Stopwatch since_a;
  WorkPtr a = link.broadcast_async(view(x), 0);
  WorkPtr b = link.broadcast_async(view(x), 0);
  const double gap_ms = since_a.ms();  // at least the time between the two submissions
  a->wait();
  b->wait();
  EXPECT_NEAR(a->duration_ms(), 30.0, 1e-6);
  EXPECT_GE(b->duration_ms(), 60.0 - gap_ms - 1e-6);  // a late second submission queues for less
  EXPECT_LE(b->duration_ms(), 60.0);
}

TEST(SimulatedLink, WireBytesFollowTheRingFormula) {
  // 4 MB over a group of four at 1 GB/s: all-reduce sends 2 * 3/4 of it,
  // reduce-scatter and all-gather 3/4, broadcast and point-to-point all of it.
  // A group of four whose operations complete at once: the formula for n > 1 on one process.
  SimulatedLink link(std::make_unique<CompletingGroup>(0, 4, "fake4"), {.latency_us = 0, .bandwidth_gbps = 1}, 60);
  auto full = random_values(1'000'000, 7);
  auto chunk = random_values(250'000, 8);
  auto check = [](WorkPtr w, double ms) {
    w->wait();
    EXPECT_NEAR(w->duration_ms(), ms, 1e-6);
  };
  check(link.all_reduce_async(view(full), ReduceOp::Sum), 6.0);
  check(link.reduce_scatter_async(view(full), view(chunk), ReduceOp::Sum), 3.0);
  check(link.all_gather_async(view(chunk), view(full)), 3.0);
  check(link.broadcast_async(view(full), 0), 4.0);
  check(link.send_async(view(full), 1, 0), 4.0);
  check(link.recv_async(view(full), 1, 0), 4.0);
  // All-to-all-v: the larger of the bytes to and from the other ranks (the
  // rows to itself stay here). Rows of 1000 floats (4 KB): 900 rows out
  // against 150 in is 3.6 MB; 0 out against 1500 in is 6 MB.
  auto rows = [](std::vector<float>& v, int64_t n) { return Tensor(v.data(), {n, 1000}, DType::F32); };
  std::vector<float> many(1'600'000), few(250'000);
  check(link.all_to_all_v_async(rows(full, 1000), {100, 200, 300, 400}, rows(few, 250), {100, 50, 50, 50}), 3.6);
  check(link.all_to_all_v_async(rows(chunk, 100), {100, 0, 0, 0}, rows(many, 1600), {100, 500, 500, 500}), 6.0);
}

TEST(SimulatedLink, GroupOfOneCollectivesPayOnlyLatency) {
  auto link = local_link({.latency_us = 2000, .bandwidth_gbps = 0.001});  // 4 MB would take 4 s
  auto x = random_values(1'000'000, 9);
  WorkPtr w = link.all_reduce_async(view(x), ReduceOp::Sum);
  w->wait();
  EXPECT_NEAR(w->duration_ms(), 2.0, 1e-6);
}

TEST(SimulatedLink, DataFlowsThroughTheInnerCommunicator) {
  auto link = local_link({.latency_us = 10000});
  auto in = random_values(4096, 10);
  auto out = random_values(4096, 11);
  Stopwatch sw;
  WorkPtr w = link.reduce_scatter_async(view(in), view(out), ReduceOp::Sum);
  w->wait();
  EXPECT_GE(sw.ms(), 10.0);
  EXPECT_EQ(out, in);

  auto gathered = random_values(4096, 12);
  sw.restart();
  link.all_gather(view(in), view(gathered));
  EXPECT_GE(sw.ms(), 10.0);
  EXPECT_EQ(gathered, in);
}

TEST(SimulatedLink, WaitIsIdempotentAndWorksFromAnotherThread) {
  auto link = local_link({.latency_us = 20000});
  auto x = random_values(1000, 13);
  Stopwatch sw;
  WorkPtr w = link.all_reduce_async(view(x), ReduceOp::Sum);
  std::thread waiter([&] { w->wait(); });
  waiter.join();
  EXPECT_GE(sw.ms(), 20.0);
  Stopwatch again;
  w->wait();
  w->wait();
  EXPECT_LT(again.ms(), 5.0);
  EXPECT_TRUE(w->test());
}

TEST(SimulatedLink, FailNextFailsExactlyTheKthOperation) {
  auto link = local_link({}, 60, "tp");
  auto in = random_values(256, 14);
  auto out1 = random_values(256, 15);
  auto out2 = random_values(256, 16);
  auto out3 = random_values(256, 17);
  const auto untouched = out2;
  link.fail_next(2);
  WorkPtr w1 = link.all_gather_async(view(in), view(out1));
  WorkPtr w2 = link.all_gather_async(view(in), view(out2));
  WorkPtr w3 = link.all_gather_async(view(in), view(out3));
  w1->wait();
  const std::vector<std::string> parts{"injected transfer failure", "tp", "all_gather", "1024 bytes"};
  expect_comm_error([&] { w2->wait(); }, parts);
  expect_comm_error([&] { w2->wait(); }, parts);  // the failure sticks
  EXPECT_TRUE(w2->test());  // complete, with an error: unlike a stall, nothing is left pending
  w3->wait();
  EXPECT_EQ(out1, in);
  EXPECT_EQ(out2, untouched);  // a failed transfer never reached the inner communicator
  EXPECT_EQ(out3, in);
}

TEST(SimulatedLink, StallNextTimesOutLikeADeadPeer) {
  auto link = local_link({}, 0.3, "pp");
  auto in = random_values(256, 18);
  auto out = random_values(256, 19);
  link.stall_next(1);
  Stopwatch sw;
  WorkPtr w = link.all_gather_async(view(in), view(out));
  EXPECT_FALSE(w->test());
  expect_comm_error([&] { w->wait(); }, {"pp", "all_gather", "1024 bytes", "did not complete within 0.3 s"});
  EXPECT_GE(sw.seconds(), 0.3);
  EXPECT_LT(sw.seconds(), 2.0);
  EXPECT_FALSE(w->test());
  EXPECT_EQ(out, in);  // the stalled operation was still submitted, so peers are not left waiting

  auto again = random_values(256, 20);
  link.all_gather(view(in), view(again));  // only the k-th operation stalls
  EXPECT_EQ(again, in);
}

TEST(SimulatedLink, RejectsANegativeModel) {
  EXPECT_THROW(local_link({.latency_us = -1}), Error);
  EXPECT_THROW(local_link({}, 0), Error);
}

}  // namespace
}  // namespace xirang
