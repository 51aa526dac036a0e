// tests/mpi/nccl_test_util.h: what the NCCL tests share (device and pinned
// buffers, a stream gate, tolerances, the GPU plan of the ranks).
#pragma once

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

inline std::string no_device_reason(cudaError_t rc) {
  return str_cat("no CUDA device is visible (", rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices", ")");
}

// This rank's device for the single-rank tests, or the reason to skip.
inline std::string single_gpu(int* device) {
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
inline const GpuPlan& gpu_per_rank() {
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
inline void expect_close(const Buf& got, const Buf& want, const std::function<double(int64_t)>& tol) {
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

inline std::function<double(int64_t)> exact() {
  return [](int64_t) { return 0.0; };
}

// Both backends are within sum_tolerance of the exact sum, each in its own
// order, so they are within twice that of each other. Max is exact.
inline std::function<double(int64_t)> reduce_tol(DType dt, ReduceOp op, uint64_t seed, int p, int64_t offset) {
  if (op == ReduceOp::Max) return exact();
  return [=](int64_t k) {
    double sum_abs = 0;
    for (int r = 0; r < p; ++r) sum_abs += std::fabs(input_value(dt, seed, r, offset + k));
    return 2 * sum_tolerance(dt, p, sum_abs);
  };
}

inline const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "max"; }

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
}  // namespace xirang::test
