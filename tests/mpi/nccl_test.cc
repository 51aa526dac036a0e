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
#include "tests/mpi/mpi_test_util.h"

namespace xirang::test {
namespace {

std::string no_device_reason(cudaError_t rc) {
  return str_cat("no CUDA device is visible (", rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices", ")");
}

// This rank's device for the single-rank tests, or the reason to skip.
std::string single_gpu(int* device) {
  int count = 0;
  cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) return no_device_reason(rc);
  *device = world_rank() % count;
  return "";
}

struct GpuPlan {
  int device = -1;
  std::string skip;  // why the multi-rank tests skip; empty when they run
};

// Decided once, by all ranks together (the first multi-rank test calls it on
// every rank), so that all ranks run a collective test or all skip it.
const GpuPlan& gpu_per_rank() {
  static const GpuPlan plan = [] {
    GpuPlan g;
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess) count = 0;
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local = 0, local_size = 1;
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    int ok = count > 0 && count >= local_size ? 1 : 0, all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (all_ok) g.device = local;
    else if (count == 0) g.skip = no_device_reason(rc);
    else if (!ok) g.skip = str_cat("NCCL needs a GPU per rank: ", local_size, " ranks share this node's ", count, " GPU(s)");
    else g.skip = "another rank has no GPU of its own";
    return g;
  }();
  return plan;
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { XR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

// Host memory the device can copy to and from without blocking the host.
struct PinnedBuf {
  void* p = nullptr;
  explicit PinnedBuf(size_t bytes) { XR_CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(bytes, 1))); }
  ~PinnedBuf() { cudaFreeHost(p); }
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
};

// A host callback that holds a stream until release() (or destruction, so a
// failing test never leaves CUDA's callback thread blocked). The callback
// owns a reference to the flag: it may still read it after the gate is gone.
class StreamGate {
 public:
  using Flag = std::shared_ptr<std::atomic<bool>>;
  explicit StreamGate(cudaStream_t s) : open_(std::make_shared<std::atomic<bool>>(false)) {
    auto* ref = new Flag(open_);
    cudaError_t status = cudaLaunchHostFunc(s, &StreamGate::hold, ref);
    if (status != cudaSuccess) delete ref;
    XR_CUDA_CHECK(status);
  }
  ~StreamGate() { release(); }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void release() { *open_ = true; }

 private:
  static void hold(void* p) {
    std::unique_ptr<Flag> ref(static_cast<Flag*>(p));
    while (!(*ref)->load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  Flag open_;
};

// got[k] against want[k]; `tol(k)` is the allowed difference (0: bit for bit
// in value). Reports the first mismatch and the count.
void expect_close(const Buf& got, const Buf& want, const std::function<double(int64_t)>& tol) {
  ASSERT_EQ(got.n, want.n);
  int64_t bad = 0, first = -1;
  for (int64_t k = 0; k < got.n; ++k)
    if (!(std::fabs(got.get(k) - want.get(k)) <= tol(k))) {
      if (first < 0) first = k;
      ++bad;
    }
  if (bad > 0)
    ADD_FAILURE() << bad << " of " << got.n << " elements differ; first at " << first << ": nccl " << got.get(first)
                  << ", mpi " << want.get(first) << " (tolerance " << tol(first) << ")";
}

std::function<double(int64_t)> exact() {
  return [](int64_t) { return 0.0; };
}

// Both backends are within sum_tolerance of the exact sum, each in its own
// order, so they are within twice that of each other. Max is exact.
std::function<double(int64_t)> reduce_tol(DType dt, ReduceOp op, uint64_t seed, int p, int64_t offset) {
  if (op == ReduceOp::Max) return exact();
  return [=](int64_t k) {
    double sum_abs = 0;
    for (int r = 0; r < p; ++r) sum_abs += std::fabs(input_value(dt, seed, r, offset + k));
    return 2 * sum_tolerance(dt, p, sum_abs);
  };
}

const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "max"; }

// Device-side plumbing shared by the tests: a compute stream that produces
// inputs and consumes outputs, the buffers, and the copies between them.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : compute_(device) {}
  ~DeviceScope() { cudaStreamSynchronize(compute_.get()); }
  cudaStream_t compute() const { return compute_.get(); }

  // A device copy of `h`, written on the compute stream.
  Tensor to_device(const Buf& h) {
    bufs_.push_back(std::make_unique<DevBuf>(h.bytes.size()));
    Tensor d(bufs_.back()->p, {h.n}, h.dt, Device::CUDA);
    XR_CUDA_CHECK(cudaMemcpyAsync(d.raw(), h.bytes.data(), d.bytes(), cudaMemcpyHostToDevice, compute()));
    return d;
  }
  // `d` read back on the compute stream after it has joined `w` (the hot
  // path's device-side join; the host only waits for the copy).
  Buf to_host(const Tensor& d, Work* w) {
    if (w) join_on_stream(*w, compute());
    Buf h(d.dtype(), d.numel());
    XR_CUDA_CHECK(cudaMemcpyAsync(h.bytes.data(), d.raw(), d.bytes(), cudaMemcpyDeviceToHost, compute()));
    compute_.synchronize();
    return h;
  }

 private:
  CudaStream compute_;
  std::vector<std::unique_ptr<DevBuf>> bufs_;
};

// A world-sized NCCL channel on its own stream fed by the compute stream,
// and the MPI channel of the same ranks for the reference results.
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

// ---- Single-rank tests: each rank on its own, one GPU is enough.

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
