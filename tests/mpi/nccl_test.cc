// Tests of NcclCommunicator against MpiCommunicator on the same inputs (every
// dtype, odd sizes, splits the group size does not divide, in place and out
// of place), of its stream semantics (input-ready join, device-side join,
// host wait, timeout and abort), and of CudaStream/CudaEvent.
//
// Without a GPU every test skips and says why. The multi-rank tests need a
// GPU per rank (NCCL refuses two ranks of one communicator on one device);
// the single-rank ones (streams, a group of one) run wherever one GPU is.
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
#include "core/rng.h"
#include "tests/mpi/mpi_test_util.h"
#include "tests/mpi/nccl_test_util.h"

namespace xirang::test {
namespace {

class NcclCollectives : public ::testing::Test {
 protected:
  void SetUp() override {
    const GpuPlan& g = gpu_per_rank();
    if (!g.skip.empty()) GTEST_SKIP() << g.skip;
    XR_CUDA_CHECK(cudaSetDevice(g.device));
    mpi_ = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "world", kOpts);
    dev_ = std::make_unique<DeviceScope>(g.device);
    comm_stream_ = std::make_unique<CudaStream>(g.device, StreamPriority::High);
    nccl_ = std::make_unique<NcclCommunicator>(*mpi_, g.device, comm_stream_->get(), kOpts);
    nccl_->set_input_ready_stream(dev_->compute());
  }
  void TearDown() override {
    nccl_.reset();  // drains the channel before its stream and buffers go
    comm_stream_.reset();
    dev_.reset();
    mpi_.reset();
  }

  std::unique_ptr<MpiCommunicator> mpi_;
  std::unique_ptr<DeviceScope> dev_;
  std::unique_ptr<CudaStream> comm_stream_;
  std::unique_ptr<NcclCommunicator> nccl_;
};

TEST_F(NcclCollectives, AllReduceMatchesMpiEveryDtype) {
  const int p = nccl_->size(), r = nccl_->rank();
  uint64_t seed = 100;
  std::vector<DType> dtypes = reduce_dtypes();
  dtypes.push_back(DType::U32);
  for (DType dt : dtypes)
    for (int64_t n : {1, 7, 1003, 262147})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
        ++seed;
        SCOPED_TRACE(str_cat("all_reduce ", op_name(op), " ", dtype_name(dt), " n=", n));
        Buf ref(dt, n);
        ref.fill(seed, r);
        Tensor d = dev_->to_device(ref);
        WorkPtr w = nccl_->all_reduce_async(d, op);
        mpi_->all_reduce(ref.t(), op);
        expect_close(dev_->to_host(d, w.get()), ref, reduce_tol(dt, op, seed, p, 0));
      }
}

TEST_F(NcclCollectives, ReduceScatterMatchesMpiEvenAndUnevenSplits) {
  const int p = nccl_->size(), r = nccl_->rank();
  uint64_t seed = 200;
  // 768 divides by 1, 2, 3 and 4 (one ncclReduceScatter); 1, 7, 1001 and
  // 65537 divide by none of 2, 3, 4 (grouped reduces; n = 1 leaves ranks empty).
  for (DType dt : reduce_dtypes())
    for (int64_t n : {1, 7, 768, 1001, 65537})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max})
        for (bool in_place : {false, true}) {
          ++seed;
          SCOPED_TRACE(str_cat("reduce_scatter ", op_name(op), " ", dtype_name(dt), " n=", n,
                               in_place ? " in place" : ""));
          auto [b, e] = split_range(n, p, r);
          Buf in(dt, n), ref(dt, e - b), poison(dt, e - b);
          in.fill(seed, r);
          poison.poison();
          Tensor din = dev_->to_device(in);
          Tensor dout = in_place ? din.flat_range(b, e) : dev_->to_device(poison);
          WorkPtr w = nccl_->reduce_scatter_async(din, dout, op);
          mpi_->reduce_scatter(in.t(), ref.t(), op);
          expect_close(dev_->to_host(dout, w.get()), ref, reduce_tol(dt, op, seed, p, b));
        }
}

TEST_F(NcclCollectives, AllGatherMatchesMpiEvenAndUnevenSplits) {
  const int p = nccl_->size(), r = nccl_->rank();
  uint64_t seed = 300;
  std::vector<DType> dtypes = reduce_dtypes();
  dtypes.push_back(DType::U16);  // moves as bytes
  for (DType dt : dtypes)
    for (int64_t n : {1, 5, 7, 768, 1001, 100003})
      for (bool in_place : {false, true}) {
        ++seed;
        SCOPED_TRACE(str_cat("all_gather ", dtype_name(dt), " n=", n, in_place ? " in place" : ""));
        auto [b, e] = split_range(n, p, r);
        Buf chunk(dt, e - b), ref(dt, n), out(dt, n);
        for (int64_t k = 0; k < e - b; ++k) chunk.set(k, input_value(dt, seed, r, b + k));
        out.poison();
        out.fill(seed, r, b, e);  // this rank's chunk in place, the rest poison
        Tensor dout = dev_->to_device(out);
        Tensor din = in_place ? dout.flat_range(b, e) : dev_->to_device(chunk);
        WorkPtr w = nccl_->all_gather_async(din, dout);
        mpi_->all_gather(chunk.t(), ref.t());
        expect_close(dev_->to_host(dout, w.get()), ref, exact());
      }
}

TEST_F(NcclCollectives, BroadcastFromEveryRootMatchesMpi) {
  uint64_t seed = 400;
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::U16, DType::U32})
    for (int64_t n : {1, 1003})
      for (int root = 0; root < nccl_->size(); ++root) {
        ++seed;
        SCOPED_TRACE(str_cat("broadcast ", dtype_name(dt), " n=", n, " root=", root));
        Buf ref(dt, n);
        ref.fill(seed, nccl_->rank());
        Tensor d = dev_->to_device(ref);
        WorkPtr w = nccl_->broadcast_async(d, root);
        mpi_->broadcast(ref.t(), root);
        expect_close(dev_->to_host(d, w.get()), ref, exact());
      }
}

// Expert parallelism's exchange: counts through exchange_counts on the
// device, then rows of uneven, sometimes empty chunks (rank `silent` sends
// none), equal bit for bit to the MPI backend's (tests/mpi/all_to_all_test.cc
// checks that one against a gathered reference).
TEST_F(NcclCollectives, AllToAllVMatchesMpi) {
  const int p = nccl_->size(), r = nccl_->rank();
  uint64_t seed = 450;
  for (DType dt : {DType::F32, DType::BF16, DType::U16})
    for (int64_t row : {1, 7, 256}) {
      ++seed;
      const int silent = int(seed % uint64_t(p));
      SCOPED_TRACE(str_cat("all_to_all_v ", dtype_name(dt), " row=", row, " silent rank ", silent));
      auto rows = [&](int src, int dst) {
        return src == silent ? int64_t{0} : int64_t(rng_below(seed, uint64_t(src), uint64_t(dst), 9));
      };
      std::vector<int64_t> sc(static_cast<size_t>(p));
      int64_t out_rows = 0, in_rows = 0;
      for (int d = 0; d < p; ++d) out_rows += sc[size_t(d)] = rows(r, d);
      const std::vector<int64_t> rc = nccl_->exchange_counts(sc);
      for (int q = 0; q < p; ++q) {
        EXPECT_EQ(rc[size_t(q)], rows(q, r)) << "count from rank " << q;
        in_rows += rc[size_t(q)];
      }
      Buf send(dt, out_rows * row), ref(dt, in_rows * row), poison(dt, in_rows * row);
      send.fill(seed, r);
      poison.poison();
      ref.poison();
      Tensor dsend = dev_->to_device(send), drecv = dev_->to_device(poison);
      WorkPtr w = nccl_->all_to_all_v_async(dsend.view({out_rows, row}), sc, drecv.view({in_rows, row}), rc);
      mpi_->all_to_all_v(send.t().view({out_rows, row}), sc, ref.t().view({in_rows, row}), rc);
      expect_close(dev_->to_host(drecv, w.get()), ref, exact());
    }
}

// A ring through sendrecv_async (both halves in one group call), then pairs
// (0, 1), (2, 3), ... with separate send and recv, issued in an order the
// two sides share: the lower rank sends first, the higher receives first.
TEST_F(NcclCollectives, SendRecvRingAndPairs) {
  const int p = nccl_->size(), r = nccl_->rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  uint64_t seed = 500;
  for (DType dt : {DType::F32, DType::BF16, DType::I32, DType::U16})
    for (int64_t n : {1, 7, 100003}) {
      ++seed;
      SCOPED_TRACE(str_cat("ring ", dtype_name(dt), " n=", n));
      Buf mine(dt, n), poison(dt, n), want(dt, n);
      mine.fill(seed, r);
      poison.poison();
      want.fill(seed, prev);
      Tensor dsend = dev_->to_device(mine), drecv = dev_->to_device(poison);
      WorkPtr w = nccl_->sendrecv_async(dsend, next, drecv, prev);
      expect_close(dev_->to_host(drecv, w.get()), want, exact());
    }
  const int partner = r % 2 == 0 ? r + 1 : r - 1;
  if (partner >= p) return;  // the odd rank out of an odd-sized world
  Buf mine(DType::F64, 1001), poison(DType::F64, 1001), want(DType::F64, 1001);
  mine.fill(600, r);
  poison.poison();
  want.fill(600, partner);
  Tensor dsend = dev_->to_device(mine), drecv = dev_->to_device(poison);
  WorkPtr first, second;
  if (r < partner) {
    first = nccl_->send_async(dsend, partner, 7);
    second = nccl_->recv_async(drecv, partner, 7);
  } else {
    first = nccl_->recv_async(drecv, partner, 7);
    second = nccl_->send_async(dsend, partner, 7);
  }
  first->wait();
  expect_close(dev_->to_host(drecv, second.get()), want, exact());
}

// The operation waits for the producer stream on the device, and the
// consumer joins it on the device: while the producer is held, the host
// submits, joins and queues the read-back without blocking, and nothing
// completes; once released, the result is the sum of the produced inputs.
TEST_F(NcclCollectives, InputReadyJoinAndDeviceJoinNeedNoHostSync) {
  const int p = nccl_->size(), r = nccl_->rank();
  const int64_t n = 4099;
  Buf input(DType::F32, n), ref(DType::F32, n), poison(DType::F32, n);
  input.fill(700, r);
  ref.fill(700, r);
  poison.poison();
  Tensor staged = dev_->to_device(input), d = dev_->to_device(poison);
  PinnedBuf back(d.bytes());
  XR_CUDA_CHECK(cudaStreamSynchronize(dev_->compute()));

  CudaEvent read_back;
  WorkPtr w;
  Stopwatch host;
  {
    StreamGate gate(dev_->compute());
    // The producer: fills d only after the gate opens.
    XR_CUDA_CHECK(cudaMemcpyAsync(d.raw(), staged.raw(), d.bytes(), cudaMemcpyDeviceToDevice, dev_->compute()));
    w = nccl_->all_reduce_async(d, ReduceOp::Sum);
    join_on_stream(*w, dev_->compute());
    XR_CUDA_CHECK(cudaMemcpyAsync(back.p, d.raw(), d.bytes(), cudaMemcpyDeviceToHost, dev_->compute()));
    read_back.record(dev_->compute());
    EXPECT_LT(host.seconds(), 5.0) << "the host blocked while the producer was held";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(w->test()) << "the all-reduce ran before its input was produced";
    EXPECT_FALSE(read_back.query()) << "the read-back ran before the all-reduce";
    gate.release();
  }
  const Stopwatch since_release;
  read_back.synchronize();
  const double after_release_ms = since_release.ms();
  EXPECT_TRUE(w->test());
  w->wait();
  // The duration starts when the input is ready (the start event sits
  // behind the producer on the compute stream), so the 50 ms the gate held
  // it are not in it.
  EXPECT_GT(w->duration_ms(), 0.0);
  EXPECT_LE(w->duration_ms(), after_release_ms) << "the duration counts the time the producer was held";
  mpi_->all_reduce(ref.t(), ReduceOp::Sum);
  Buf got(DType::F32, n);
  std::memcpy(got.bytes.data(), back.p, d.bytes());
  expect_close(got, ref, reduce_tol(DType::F32, ReduceOp::Sum, 700, p, 0));
}

// Operations of different kinds in flight at once on the channel, waited for
// on the host in reverse order.
TEST_F(NcclCollectives, SeveralInFlightWaitedInReverseOrder) {
  const int p = nccl_->size(), r = nccl_->rank();
  const int64_t n_rs = 1003, n_ag = 999;
  auto [rb, re] = split_range(n_rs, p, r);
  auto [gb, ge] = split_range(n_ag, p, r);
  Buf sum(DType::F32, 1001), mx(DType::F64, 77), rs_in(DType::BF16, n_rs), rs_ref(DType::BF16, re - rb);
  Buf ag_in(DType::I32, ge - gb), ag_ref(DType::I32, n_ag), bc(DType::F16, 501);
  sum.fill(1, r);
  mx.fill(2, r);
  rs_in.fill(3, r);
  for (int64_t k = 0; k < ge - gb; ++k) ag_in.set(k, input_value(DType::I32, 4, r, gb + k));
  ag_ref.poison();
  bc.fill(5, r);
  Tensor dsum = dev_->to_device(sum), dmx = dev_->to_device(mx), drs_in = dev_->to_device(rs_in);
  Tensor drs_out = dev_->to_device(rs_ref), dag_in = dev_->to_device(ag_in), dag_out = dev_->to_device(ag_ref);
  Tensor dbc = dev_->to_device(bc);

  Stopwatch wall;  // from before the first submission: no operation can take longer
  std::vector<WorkPtr> works;
  works.push_back(nccl_->all_reduce_async(dsum, ReduceOp::Sum));
  works.push_back(nccl_->all_reduce_async(dmx, ReduceOp::Max));
  works.push_back(nccl_->reduce_scatter_async(drs_in, drs_out, ReduceOp::Sum));
  works.push_back(nccl_->all_gather_async(dag_in, dag_out));
  works.push_back(nccl_->broadcast_async(dbc, p - 1));
  for (auto it = works.rbegin(); it != works.rend(); ++it) {
    (*it)->wait();
    EXPECT_TRUE((*it)->test());
    EXPECT_GT((*it)->duration_ms(), 0.0);
    EXPECT_LE((*it)->duration_ms(), wall.ms());
  }
  mpi_->all_reduce(sum.t(), ReduceOp::Sum);
  mpi_->all_reduce(mx.t(), ReduceOp::Max);
  mpi_->reduce_scatter(rs_in.t(), rs_ref.t(), ReduceOp::Sum);
  mpi_->all_gather(ag_in.t(), ag_ref.t());
  mpi_->broadcast(bc.t(), p - 1);
  expect_close(dev_->to_host(dsum, nullptr), sum, reduce_tol(DType::F32, ReduceOp::Sum, 1, p, 0));
  expect_close(dev_->to_host(dmx, nullptr), mx, exact());
  expect_close(dev_->to_host(drs_out, nullptr), rs_ref, reduce_tol(DType::BF16, ReduceOp::Sum, 3, p, rb));
  expect_close(dev_->to_host(dag_out, nullptr), ag_ref, exact());
  expect_close(dev_->to_host(dbc, nullptr), bc, exact());
}

TEST_F(NcclCollectives, BarrierSynchronizeAndIdentity) {
  for (int k = 0; k < 5; ++k) nccl_->barrier();
  nccl_->synchronize();
  EXPECT_EQ(nccl_->name(), "world");
  EXPECT_EQ(nccl_->rank(), mpi_->rank());
  EXPECT_EQ(nccl_->size(), mpi_->size());
}

// Rank 0 receives from rank 1, which never sends: the host wait (or NCCL's
// set-up of the connection, which also needs the peer) times out with a Comm
// error naming the group and the operation, the communicator is aborted, and
// the channel refuses later work. Every channel still destructs.
TEST_F(NcclCollectives, TimeoutAbortsAndBreaksTheChannel) {
  if (nccl_->size() < 2) GTEST_SKIP() << "needs two ranks";
  CudaStream s(nccl_->device());
  {
    NcclCommunicator c(*mpi_, nccl_->device(), s.get(), CommOptions{.timeout_s = 3});
    Buf poison(DType::F32, 10);
    poison.poison();
    Tensor d = dev_->to_device(poison);
    XR_CUDA_CHECK(cudaStreamSynchronize(dev_->compute()));
    if (c.rank() == 0) {
      Stopwatch sw;
      expect_error([&] { c.recv_async(d, 1, 0)->wait(); }, ErrorKind::Comm, {"world recv of 40 bytes", "within 3 s"});
      EXPECT_LT(sw.seconds(), 30.0);
      expect_error([&] { c.all_reduce_async(d, ReduceOp::Sum); }, ErrorKind::Comm, {"refused", "broken"});
    }
  }
  mpi_->barrier();
}

}  // namespace
}  // namespace xirang::test
