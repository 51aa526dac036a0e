// Single-rank tests of NcclCommunicator (a group of one: copies, argument
// errors, the comm trace) and of CudaStream/CudaEvent; each rank on its own,
// one GPU is enough. Without a GPU every test skips and says why.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include "comm/comm_trace.h"
#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/clock.h"
#include "core/cuda_check.h"
#include "core/cuda_stream.h"
#include "tests/mpi/mpi_test_util.h"
#include "tests/mpi/nccl_test_util.h"

namespace xirang::test {
namespace {

TEST(NcclGroupOfOne, EveryOperationIsACopyAndBadArgumentsAreCommErrors) {
  int device = 0;
  std::string skip = single_gpu(&device);
  if (!skip.empty()) GTEST_SKIP() << skip;
  XR_CUDA_CHECK(cudaSetDevice(device));
  LocalCommunicator bootstrap("solo");
  DeviceScope dev(device);
  NcclCommunicator c(bootstrap, device, dev.compute(), kOpts);
  ASSERT_EQ(c.size(), 1);
  ASSERT_EQ(c.rank(), 0);
  const int r = world_rank();
  Buf a(DType::BF16, 9), in(DType::F32, 9), poison(DType::F32, 9), bc(DType::F64, 4), u(DType::U16, 5);
  a.fill(1, r);
  in.fill(2, r);
  poison.poison();
  bc.fill(3, r);
  u.fill(4, r);
  Tensor da = dev.to_device(a), din = dev.to_device(in), dout = dev.to_device(poison);
  Tensor dbc = dev.to_device(bc), du = dev.to_device(u), du_back = dev.to_device(u);
  expect_close(dev.to_host(da, c.all_reduce_async(da, ReduceOp::Sum).get()), a, exact());
  expect_close(dev.to_host(dout, c.reduce_scatter_async(din, dout, ReduceOp::Max).get()), in, exact());
  XR_CUDA_CHECK(cudaMemsetAsync(dout.raw(), 0, dout.bytes(), dev.compute()));
  expect_close(dev.to_host(dout, c.all_gather_async(din, dout).get()), in, exact());
  expect_close(dev.to_host(dbc, c.broadcast_async(dbc, 0).get()), bc, exact());
  XR_CUDA_CHECK(cudaMemsetAsync(du_back.raw(), 0, du_back.bytes(), dev.compute()));
  expect_close(dev.to_host(du_back, c.sendrecv_async(du, 0, du_back, 0).get()), u, exact());
  c.barrier();
  c.synchronize();

  expect_error([&] { c.all_reduce_async(in.t(), ReduceOp::Sum); }, ErrorKind::Comm,
               {"solo all_reduce of 36 bytes", "not in device memory"});
  expect_error([&] { c.all_reduce_async(du, ReduceOp::Max); }, ErrorKind::Comm, {"solo all_reduce", "cannot reduce u16"});
  expect_error([&] { c.send_async(din, 0, 1); }, ErrorKind::Comm, {"solo send", "sendrecv_async"});
  expect_error([&] { c.broadcast_async(dbc, 1); }, ErrorKind::Comm, {"solo broadcast", "root must be in [0, 1)"});
  expect_error([&] { c.reduce_scatter_async(din, din.flat_range(1, 9), ReduceOp::Sum); }, ErrorKind::Comm,
               {"solo reduce_scatter", "must hold this rank's chunk"});
  // A bad argument is refused before anything reaches NCCL: the channel still works.
  expect_close(dev.to_host(da, c.all_reduce_async(da, ReduceOp::Max).get()), a, exact());
}

// The NCCL channel records its operations in the comm trace ring the MPI
// channels use (comm/comm_trace.h), for `xirang diagnose`: kind, channel,
// peer and tag, bytes, the channel's sequence numbers, and completion.
TEST(NcclGroupOfOne, OperationsAreRecordedInTheCommTrace) {
  int device = 0;
  std::string skip = single_gpu(&device);
  if (!skip.empty()) GTEST_SKIP() << skip;
  XR_CUDA_CHECK(cudaSetDevice(device));
  LocalCommunicator bootstrap("solo");
  DeviceScope dev(device);
  CommTrace trace(world_rank(), world_size(), "");
  CommOptions opts = kOpts;
  opts.trace = &trace;
  NcclCommunicator c(bootstrap, device, dev.compute(), opts);
  ASSERT_EQ(trace.channels().size(), 1u);
  EXPECT_EQ(trace.channels()[0].group, "solo");
  EXPECT_EQ(trace.channels()[0].world_ranks, std::vector<int>{world_rank()});
  const int r = world_rank();
  Buf a(DType::F32, 9), b(DType::F32, 5);
  a.fill(1, r);
  b.fill(2, r);
  Tensor da = dev.to_device(a), db = dev.to_device(a), dc = dev.to_device(b);
  c.all_reduce_async(da, ReduceOp::Sum)->wait();
  c.broadcast_async(dc, 0)->wait();
  c.sendrecv_async(da, 0, db, 0)->wait();
  c.all_reduce_async(da, ReduceOp::Max)->wait();
  const std::vector<CommOpRecord> ops = trace.records();
  ASSERT_EQ(ops.size(), 5u);
  const CommOpKind kinds[] = {CommOpKind::AllReduce, CommOpKind::Broadcast, CommOpKind::Send, CommOpKind::Recv,
                              CommOpKind::AllReduce};
  const uint64_t seqs[] = {1, 2, 1, 2, 3};  // collectives and point-to-point operations count apart
  const int64_t bytes[] = {36, 20, 36, 36, 36};
  for (size_t i = 0; i < ops.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(ops[i].channel, 0);
    EXPECT_EQ(ops[i].kind, kinds[i]);
    EXPECT_EQ(ops[i].seq, seqs[i]);
    EXPECT_EQ(ops[i].bytes, bytes[i]);
    EXPECT_EQ(ops[i].state, CommOpState::Done);
    EXPECT_EQ(ops[i].peer, is_collective(kinds[i]) ? -1 : 0);
    EXPECT_GT(ops[i].posted_s, 0.0);
    EXPECT_GE(ops[i].completed_s, ops[i].posted_s);
  }
}

// A group of one's all-to-all-v is a device copy of its own rows; the
// counts exchange returns them; both are traced as all_to_all_v.
TEST(NcclGroupOfOne, AllToAllVCopiesItsOwnRowsAndIsTraced) {
  int device = 0;
  std::string skip = single_gpu(&device);
  if (!skip.empty()) GTEST_SKIP() << skip;
  XR_CUDA_CHECK(cudaSetDevice(device));
  LocalCommunicator bootstrap("ep");
  DeviceScope dev(device);
  CommTrace trace(world_rank(), world_size(), "");
  CommOptions opts = kOpts;
  opts.trace = &trace;
  NcclCommunicator c(bootstrap, device, dev.compute(), opts);
  EXPECT_EQ(c.exchange_counts({(int64_t{3} << 33) + 5}), std::vector<int64_t>{(int64_t{3} << 33) + 5});
  Buf in(DType::BF16, 12), poison(DType::BF16, 12);
  in.fill(5, world_rank());
  poison.poison();
  Tensor din = dev.to_device(in), dout = dev.to_device(poison);
  WorkPtr w = c.all_to_all_v_async(din.view({4, 3}), {4}, dout.view({4, 3}), {4});
  expect_close(dev.to_host(dout, w.get()), in, exact());
  expect_error([&] { c.all_to_all_v_async(in.t().view({4, 3}), {4}, dout.view({4, 3}), {4}); }, ErrorKind::Comm,
               {"ep all_to_all_v", "send tensor", "not in device memory"});
  const std::vector<CommOpRecord> ops = trace.records();
  ASSERT_EQ(ops.size(), 2u);
  EXPECT_EQ(ops[0].kind, CommOpKind::AllToAllV);
  EXPECT_EQ(ops[0].bytes, 8);  // one count of 8 bytes
  EXPECT_EQ(ops[1].kind, CommOpKind::AllToAllV);
  EXPECT_EQ(ops[1].bytes, 24);
  EXPECT_EQ(ops[1].seq, 2u);
}

TEST(NcclGroupOfOne, MissingDeviceIsACommError) {
  int device = 0;
  std::string skip = single_gpu(&device);
  if (!skip.empty()) GTEST_SKIP() << skip;
  int count = 0;
  XR_CUDA_CHECK(cudaGetDeviceCount(&count));
  LocalCommunicator bootstrap("solo");
  expect_error([&] { NcclCommunicator c(bootstrap, count, nullptr, kOpts); }, ErrorKind::Comm,
               {"NCCL set-up of group solo", "does not exist"});
}

TEST(CudaStreams, NonBlockingStreamsPrioritiesAndDeviceGuard) {
  int device = 0;
  std::string skip = single_gpu(&device);
  if (!skip.empty()) GTEST_SKIP() << skip;
  CudaStream normal(device), high(device, StreamPriority::High);
  unsigned flags = 0;
  XR_CUDA_CHECK(cudaStreamGetFlags(normal.get(), &flags));
  EXPECT_EQ(flags & cudaStreamNonBlocking, unsigned(cudaStreamNonBlocking));
  int least = 0, greatest = 0, pn = 0, ph = 0;
  XR_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  XR_CUDA_CHECK(cudaStreamGetPriority(normal.get(), &pn));
  XR_CUDA_CHECK(cudaStreamGetPriority(high.get(), &ph));
  EXPECT_EQ(pn, least);
  EXPECT_EQ(ph, greatest);  // numerically lower: scheduled first
  CudaStream moved(std::move(high));
  EXPECT_EQ(high.get(), nullptr);
  EXPECT_EQ(moved.priority(), StreamPriority::High);

  int before = -1, after = -1;
  XR_CUDA_CHECK(cudaGetDevice(&before));
  { CudaDeviceGuard guard(device); }
  XR_CUDA_CHECK(cudaGetDevice(&after));
  EXPECT_EQ(before, after);
}

// stream_wait orders two streams on the device: while the producer is held,
// the waiting stream does not run and the host is not blocked.
TEST(CudaStreams, StreamWaitIsDeviceSide) {
  int device = 0;
  std::string skip = single_gpu(&device);
  if (!skip.empty()) GTEST_SKIP() << skip;
  XR_CUDA_CHECK(cudaSetDevice(device));
  CudaStream producer(device), consumer(device);
  DevBuf src(4096), dst(4096);
  PinnedBuf host(4096);
  XR_CUDA_CHECK(cudaMemset(src.p, 0x5a, 4096));
  XR_CUDA_CHECK(cudaMemset(dst.p, 0, 4096));
  XR_CUDA_CHECK(cudaDeviceSynchronize());
  CudaEvent ready, never_recorded;
  EXPECT_TRUE(never_recorded.query());
  {
    StreamGate gate(producer.get());
    XR_CUDA_CHECK(cudaMemcpyAsync(dst.p, src.p, 4096, cudaMemcpyDeviceToDevice, producer.get()));
    Stopwatch sw;
    stream_wait(consumer.get(), producer.get(), ready);
    XR_CUDA_CHECK(cudaMemcpyAsync(host.p, dst.p, 4096, cudaMemcpyDeviceToHost, consumer.get()));
    EXPECT_LT(sw.seconds(), 5.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(ready.query());
    EXPECT_EQ(cudaStreamQuery(consumer.get()), cudaErrorNotReady);
    cudaGetLastError();  // a not-ready answer may linger as the last error
    gate.release();
  }
  consumer.synchronize();
  EXPECT_TRUE(ready.query());
  const auto* bytes = static_cast<const unsigned char*>(host.p);
  EXPECT_EQ(std::count(bytes, bytes + 4096, 0x5a), 4096) << "the consumer read before the producer wrote";
  // Waiting on itself is a no-op, not a self-deadlock.
  stream_wait(consumer.get(), consumer.get(), ready);
  consumer.synchronize();
}

TEST(CudaStreams, TimingEventsMeasureDeviceTime) {
  int device = 0;
  std::string skip = single_gpu(&device);
  if (!skip.empty()) GTEST_SKIP() << skip;
  XR_CUDA_CHECK(cudaSetDevice(device));
  CudaStream s(device);
  CudaEvent start(EventTiming::Enabled), end(EventTiming::Enabled), plain;
  start.record(s.get());
  XR_CUDA_CHECK(cudaLaunchHostFunc(
      s.get(), [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }, nullptr));
  end.record(s.get());
  plain.record(s.get());
  end.synchronize();
  float ms = elapsed_ms(start, end);
  EXPECT_GE(ms, 15.0f);
  EXPECT_LT(ms, 5000.0f);
  expect_error([&] { elapsed_ms(start, plain); }, ErrorKind::Internal, {"two timing events"});
  CudaEvent moved(std::move(start));
  EXPECT_EQ(start.get(), nullptr);
  EXPECT_EQ(moved.timing(), EventTiming::Enabled);
}

}  // namespace
}  // namespace xirang::test
