#include "comm/nccl_communicator.h"

#include <nccl.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>

#include "comm/nccl_check.h"
#include "comm/nccl_state.h"
#include "core/clock.h"
#include "core/cuda_check.h"
#include "core/error.h"

// Non-blocking communicators (config.blocking = 0, ncclCommFinalize) came in 2.14.
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "the NCCL backend needs NCCL 2.14 or newer"
#endif

namespace xirang {

using nccl_detail::is_failure;

namespace {


// How a dtype travels: NCCL's element type and elements per tensor element.
// NCCL has no 16-bit integer, so u16 moves as bytes (data movement only).
struct WireType {
  ncclDataType_t type;
  size_t per_element;
  size_t count(int64_t n) const { return size_t(n) * per_element; }
};

WireType wire_type(DType t) {
  switch (t) {
    case DType::F32: return {ncclFloat32, 1};
    case DType::F64: return {ncclFloat64, 1};
    case DType::BF16: return {ncclBfloat16, 1};
    case DType::F16: return {ncclFloat16, 1};
    case DType::I32: return {ncclInt32, 1};
    case DType::U32: return {ncclUint32, 1};
    case DType::U16: return {ncclUint8, 2};
  }
  fail(ErrorKind::Internal, "wire_type: unhandled dtype ", int(t));
}

WireType reduce_type(const std::string& what, DType t) {
  if (t == DType::U16)
    fail(ErrorKind::Comm, what, ": NCCL cannot reduce u16 (it has no 16-bit integer type); reduce as i32 or u32");
  return wire_type(t);
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

void check_device(const std::string& what, const Tensor& t, const char* role) {
  if (t.device() != Device::CUDA)
    fail(ErrorKind::Comm, what, ": ", role, " ", t.str(), " is not in device memory (the NCCL backend needs CUDA tensors)");
  if (t.numel() > 0 && !t.defined()) fail(ErrorKind::Comm, what, ": ", role, " ", t.str(), " has no memory");
}

bool overlaps(const Tensor& a, const Tensor& b) {
  auto pa = static_cast<const char*>(a.raw()), pb = static_cast<const char*>(b.raw());
  return a.bytes() > 0 && b.bytes() > 0 && pa < pb + b.bytes() && pb < pa + a.bytes();
}

char* element(const Tensor& t, int64_t i) { return static_cast<char*>(t.raw()) + size_t(i) * dtype_size(t.dtype()); }


}  // namespace


namespace {

// Runs `calls` as one NCCL group (they progress together and are launched
// as one), then settles the group. `calls` returns the first failing result.
void group_call(NcclState& s, const std::string& what, const std::function<ncclResult_t()>& calls) {
  ncclResult_t rc = ncclGroupStart();
  if (rc != ncclSuccess) s.settle_locked(rc, what);
  ncclResult_t inner = calls();
  // The group is closed even after a failed call, or NCCL stays inside it.
  ncclResult_t end = ncclGroupEnd();
  s.settle_locked(is_failure(inner) ? inner : end, what);
}

}  // namespace


// ---- NcclCommunicator: set-up and shutdown

NcclCommunicator::NcclCommunicator(Communicator& group, int device, cudaStream_t stream, const CommOptions& opts)
    : state_(std::make_shared<NcclState>()), stream_(stream), input_ready_(stream) {
  NcclState& s = *state_;
  s.name = group.name();
  s.rank = group.rank();
  s.size = group.size();
  s.device = device;
  s.opts = opts;
  std::string what = str_cat("NCCL set-up of group ", s.name);
  if (!(opts.timeout_s > 0)) fail(ErrorKind::Comm, what, ": timeout_s must be positive, got ", opts.timeout_s);
  int count = 0;
  cudaError_t crc = cudaGetDeviceCount(&count);
  if (crc != cudaSuccess || count == 0)
    fail(ErrorKind::Comm, what, ": no CUDA device is visible (",
         crc != cudaSuccess ? cudaGetErrorString(crc) : "0 devices", ") ", s.where());
  if (device < 0 || device >= count)
    fail(ErrorKind::Comm, what, ": CUDA device ", device, " does not exist (", count, " visible) ", s.where());
  CudaDeviceGuard guard(device);
  // Allocated before the NCCL communicator exists: cudaMalloc may synchronize
  // the device, which must not happen while NCCL kernels wait for peers.
  XR_CUDA_CHECK(cudaMalloc(&scratch_, 3 * sizeof(float)));  // barrier(); connect_neighbours()
  if (cudaMalloc(&counts_, 4 * size_t(s.size) * sizeof(uint32_t)) != cudaSuccess) {
    cudaFree(scratch_);
    fail(ErrorKind::Comm, what, ": no device memory for the counts buffer of exchange_counts ", s.where());
  }
  try {
    XR_CUDA_CHECK(cudaMemset(scratch_, 0, 3 * sizeof(float)));  // its values never matter
    // Rank 0 makes the id and sends it with a success flag, so that when it
    // cannot, the others fail at once instead of waiting for a timeout.
    std::array<uint32_t, 1 + sizeof(ncclUniqueId) / 4> msg{};
    static_assert(sizeof(ncclUniqueId) % 4 == 0, "the id travels as u32 words");
    std::string id_error;
    if (s.rank == 0) {
      ncclUniqueId id;
      ncclResult_t rc = ncclGetUniqueId(&id);
      if (rc == ncclSuccess) {
        msg[0] = 1;
        std::memcpy(&msg[1], &id, sizeof(id));
      } else {
        id_error = str_cat(": ", ncclGetErrorString(rc));
      }
    }
    group.broadcast(Tensor(msg.data(), {int64_t(msg.size())}, DType::U32), 0);
    if (msg[0] != 1)
      fail(ErrorKind::Comm, what, ": rank 0 of the group could not create an NCCL id", id_error, " ", s.where());
    ncclUniqueId id;
    std::memcpy(&id, &msg[1], sizeof(id));
    if (opts.trace) {
      // The group's world ranks, by group rank, for the trace's channel description.
      std::vector<double> slots(size_t(s.size), 0.0);
      slots[size_t(s.rank)] = opts.trace->world_rank();
      group.all_reduce(Tensor(slots.data(), {int64_t(s.size)}, DType::F64), ReduceOp::Sum);
      std::vector<int> world_ranks;
      for (double r : slots) world_ranks.push_back(int(r));
      s.trace_channel = opts.trace->add_channel(s.name, s.rank, std::move(world_ranks));
    }

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // see settle_locked
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    config.commName = s.name.c_str();  // NCCL's own log lines then name the group
#endif
    std::lock_guard<std::mutex> lk(s.mu);
    ncclResult_t rc = ncclCommInitRankConfig(&s.comm, s.size, id, s.rank, &config);
    s.settle_locked(rc, what);
  } catch (...) {
    cudaFree(scratch_);
    cudaFree(counts_);
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  NcclState& s = *state_;
  bool broken = false;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    broken = s.broken;  // an aborted communicator has nothing left to drain
  }
  if (!broken) {
    try {
      synchronize();
    } catch (...) {
      // synchronize() timed out or saw an error and aborted the communicator;
      // a destructor has no caller to report it to.
    }
  }
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.comm) {
      try {
        CudaDeviceGuard guard(s.device);
        // Finalize is non-blocking here and flushes NCCL's own work; then
        // destroy only frees local resources. A failure or a timeout aborts.
        s.settle_locked(ncclCommFinalize(s.comm), str_cat(s.name, " NCCL shutdown"));
        ncclCommDestroy(s.comm);
        s.comm = nullptr;
      } catch (...) {
        s.abort_locked(str_cat("channel ", s.name, " was destroyed"));
      }
    }
  }
  cudaFree(scratch_);
  cudaFree(counts_);
}

int NcclCommunicator::rank() const { return state_->rank; }
int NcclCommunicator::size() const { return state_->size; }
const std::string& NcclCommunicator::name() const { return state_->name; }
int NcclCommunicator::device() const { return state_->device; }

void NcclCommunicator::set_input_ready_stream(cudaStream_t producer) {
  std::lock_guard<std::mutex> lk(state_->mu);  // launch() reads it under the same lock
  input_ready_ = producer;
}

// ---- Operations

WorkPtr NcclCommunicator::launch(const std::string& what, const std::vector<NcclTraceOp>& ops,
                                 const std::function<void(NcclState&, cudaStream_t)>& body) {
  NcclState& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.broken || !s.comm)
    fail(ErrorKind::Comm, what, " refused: channel ", s.name, " is broken since an earlier operation failed: ",
         s.broken_reason);
  CudaDeviceGuard guard(s.device);
  double submitted = now_seconds();
  CudaEvent start(EventTiming::Enabled), done(EventTiming::Enabled);
  // The input-ready join: the operation starts after the producer's queued
  // kernels. `start` doubles as the duration's first timestamp.
  start.record(input_ready_);
  if (input_ready_ != stream_) stream_wait(stream_, start);
  body(s, stream_);
  done.record(stream_);
  std::vector<uint64_t> ids;
  if (CommTrace* trace = s.opts.trace) {
    for (const NcclTraceOp& op : ops) {
      const uint64_t seq = is_collective(op.kind) ? ++s.collectives : ++s.p2p;
      ids.push_back(trace->posted(s.trace_channel, op.kind, op.peer, op.tag, op.bytes, seq, submitted));
      trace->started(ids.back(), submitted);
    }
  }
  return std::make_shared<NcclWork>(state_, what, submitted, std::move(start), std::move(done), std::move(ids));
}

WorkPtr NcclCommunicator::all_reduce_async(Tensor t, ReduceOp op) {
  std::string what = str_cat(name(), " all_reduce of ", t.bytes(), " bytes (", dtype_name(t.dtype()), ")");
  check_device(what, t, "tensor");
  WireType w = reduce_type(what, t.dtype());
  return launch(what, {{CommOpKind::AllReduce, -1, -1, int64_t(t.bytes())}}, [&](NcclState& s, cudaStream_t st) {
    if (t.numel() == 0) return;
    s.settle_locked(ncclAllReduce(t.raw(), t.raw(), w.count(t.numel()), w.type, nccl_op(op), s.comm, st), what);
  });
}

// The shapes were checked by Communicator::reduce_scatter_async.
WorkPtr NcclCommunicator::do_reduce_scatter(const Tensor& in, Tensor out, ReduceOp op) {
  std::string what = str_cat(name(), " reduce_scatter of ", in.bytes(), " bytes (", dtype_name(in.dtype()), ")");
  check_device(what, in, "input");
  check_device(what, out, "output");
  const int p = size(), me = rank();
  const int64_t n = in.numel();
  WireType w = reduce_type(what, in.dtype());
  return launch(what, {{CommOpKind::ReduceScatter, -1, -1, int64_t(in.bytes())}}, [&](NcclState& s, cudaStream_t st) {
    if (n == 0) return;
    if (n % p == 0) {
      // In place when out is this rank's chunk: NCCL's in-place condition
      // (recvbuff == sendbuff + rank * recvcount) is exactly that.
      s.settle_locked(ncclReduceScatter(in.raw(), out.raw(), w.count(n / p), w.type, nccl_op(op), s.comm, st), what);
      return;
    }
    group_call(s, what, [&] {
      for (int r = 0; r < p; ++r) {
        auto [b, e] = split_range(n, p, r);
        if (e == b) continue;  // every rank skips the same empty chunks
        // Only the root's receive buffer is written; `out` may be the chunk
        // itself (sendbuff == recvbuff: NCCL's in-place form).
        void* recv = r == me ? out.raw() : nullptr;
        ncclResult_t rc = ncclReduce(element(in, b), recv, w.count(e - b), w.type, nccl_op(op), r, s.comm, st);
        if (is_failure(rc)) return rc;
      }
      return ncclSuccess;
    });
  });
}

// The shapes were checked by Communicator::all_gather_async.
WorkPtr NcclCommunicator::do_all_gather(const Tensor& in, Tensor out) {
  std::string what = str_cat(name(), " all_gather of ", out.bytes(), " bytes (", dtype_name(out.dtype()), ")");
  check_device(what, in, "input");
  check_device(what, out, "output");
  const int p = size(), me = rank();
  const int64_t n = out.numel();
  WireType w = wire_type(out.dtype());
  return launch(what, {{CommOpKind::AllGather, -1, -1, int64_t(out.bytes())}}, [&](NcclState& s, cudaStream_t st) {
    if (n == 0) return;
    if (n % p == 0) {
      s.settle_locked(ncclAllGather(in.raw(), out.raw(), w.count(n / p), w.type, s.comm, st), what);
      return;
    }
    group_call(s, what, [&] {
      for (int r = 0; r < p; ++r) {
        auto [b, e] = split_range(n, p, r);
        if (e == b) continue;
        // The root sends its input (in place when it already is its chunk);
        // the others receive into the chunk, their send buffer unused.
        void* chunk = element(out, b);
        const void* send = r == me ? in.raw() : chunk;
        ncclResult_t rc = ncclBroadcast(send, chunk, w.count(e - b), w.type, r, s.comm, st);
        if (is_failure(rc)) return rc;
      }
      return ncclSuccess;
    });
  });
}

// The arguments were checked by Communicator::all_to_all_v_async.
WorkPtr NcclCommunicator::do_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor recv,
                                          const std::vector<int64_t>& recv_counts, int64_t row) {
  std::string what = str_cat(name(), " all_to_all_v of ", send.bytes(), " bytes out, ", recv.bytes(), " bytes in (",
                             dtype_name(send.dtype()), ")");
  check_device(what, send, "send tensor");
  check_device(what, recv, "recv tensor");
  const int p = size(), me = rank();
  const WireType w = wire_type(send.dtype());
  const std::vector<int64_t> soff = chunk_offsets(send_counts, row), roff = chunk_offsets(recv_counts, row);
  const size_t own = size_t(send_counts[size_t(me)] * row) * dtype_size(send.dtype());
  return launch(what, {{CommOpKind::AllToAllV, -1, -1, int64_t(send.bytes())}}, [&](NcclState& s, cudaStream_t st) {
    if (own > 0)
      XR_CUDA_CHECK(cudaMemcpyAsync(element(recv, roff[size_t(me)]), element(send, soff[size_t(me)]), own,
                                    cudaMemcpyDeviceToDevice, st));
    group_call(s, what, [&] {
      for (int q = 0; q < p; ++q) {
        if (q == me) continue;
        const size_t sq = size_t(q);
        if (send_counts[sq] > 0) {
          ncclResult_t rc = ncclSend(element(send, soff[sq]), w.count(send_counts[sq] * row), w.type, q, s.comm, st);
          if (is_failure(rc)) return rc;
        }
        if (recv_counts[sq] > 0) {
          ncclResult_t rc = ncclRecv(element(recv, roff[sq]), w.count(recv_counts[sq] * row), w.type, q, s.comm, st);
          if (is_failure(rc)) return rc;
        }
      }
      return ncclSuccess;
    });
  });
}

// Counts as two u32 words each (Communicator::exchange_counts), through the
// channel's device buffer: out at [0, 2p), in at [2p, 4p).
std::vector<int64_t> NcclCommunicator::exchange_counts(const std::vector<int64_t>& send_counts) {
  const int p = size();
  if (int64_t(send_counts.size()) != p)
    fail(ErrorKind::Comm, name(), " exchange_counts: ", send_counts.size(), " counts, expected one per rank of the group (",
         p, ") ", state_->where());
  std::vector<uint32_t> words(4 * size_t(p));
  for (int r = 0; r < p; ++r) {
    if (send_counts[size_t(r)] < 0)
      fail(ErrorKind::Comm, name(), " exchange_counts: count for rank ", r, " is ", send_counts[size_t(r)],
           " (negative) ", state_->where());
    const auto u = uint64_t(send_counts[size_t(r)]);
    words[2 * size_t(r)] = uint32_t(u);
    words[2 * size_t(r) + 1] = uint32_t(u >> 32);
  }
  uint32_t* dev = static_cast<uint32_t*>(counts_);
  {
    CudaDeviceGuard guard(device());
    // Synchronous on the host: the staging copy is taken before it returns,
    // and the all-to-all below is ordered after it on the same stream.
    XR_CUDA_CHECK(cudaMemcpyAsync(dev, words.data(), 2 * size_t(p) * sizeof(uint32_t), cudaMemcpyHostToDevice, stream_));
  }
  const std::vector<int64_t> ones(size_t(p), 1);
  const Tensor out(dev, {int64_t(p), 2}, DType::U32, Device::CUDA), in(dev + 2 * p, {int64_t(p), 2}, DType::U32, Device::CUDA);
  all_to_all_v_async(out, ones, in, ones)->wait();
  {
    CudaDeviceGuard guard(device());
    XR_CUDA_CHECK(cudaMemcpyAsync(words.data() + 2 * p, in.raw(), 2 * size_t(p) * sizeof(uint32_t),
                                  cudaMemcpyDeviceToHost, stream_));
    XR_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  std::vector<int64_t> got(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    const size_t k = 2 * size_t(p + r);
    got[size_t(r)] = int64_t(uint64_t(words[k]) | uint64_t(words[k + 1]) << 32);
  }
  return got;
}

WorkPtr NcclCommunicator::broadcast_async(Tensor t, int root) {
  std::string what =
      str_cat(name(), " broadcast of ", t.bytes(), " bytes (", dtype_name(t.dtype()), ") from rank ", root);
  check_device(what, t, "tensor");
  if (root < 0 || root >= size()) fail(ErrorKind::Comm, what, ": root must be in [0, ", size(), ")");
  WireType w = wire_type(t.dtype());
  return launch(what, {{CommOpKind::Broadcast, -1, -1, int64_t(t.bytes())}}, [&](NcclState& s, cudaStream_t st) {
    if (t.numel() == 0) return;
    s.settle_locked(ncclBroadcast(t.raw(), t.raw(), w.count(t.numel()), w.type, root, s.comm, st), what);
  });
}

namespace {
void check_peer(const std::string& what, int peer, int size) {
  if (peer < 0 || peer >= size) fail(ErrorKind::Comm, what, ": peer must be a rank in [0, ", size, ")");
}
void check_p2p(const std::string& what, int peer, int tag, int rank, int size) {
  check_peer(what, peer, size);
  if (tag < 0) fail(ErrorKind::Comm, what, ": tag must be non-negative");
  if (peer == rank)
    fail(ErrorKind::Comm, what, ": a send or recv to this rank itself would wait forever for its other half on the "
         "NCCL backend; use sendrecv_async");
}
}  // namespace

WorkPtr NcclCommunicator::send_async(const Tensor& t, int peer, int tag) {
  std::string what = str_cat(name(), " send of ", t.bytes(), " bytes (", dtype_name(t.dtype()), ") to rank ", peer);
  check_device(what, t, "tensor");
  check_p2p(what, peer, tag, rank(), size());
  WireType w = wire_type(t.dtype());
  return launch(what, {{CommOpKind::Send, peer, tag, int64_t(t.bytes())}}, [&](NcclState& s, cudaStream_t st) {
    if (t.numel() == 0) return;  // the matching recv (same count) skips too
    s.settle_locked(ncclSend(t.raw(), w.count(t.numel()), w.type, peer, s.comm, st), what);
  });
}

WorkPtr NcclCommunicator::recv_async(Tensor t, int peer, int tag) {
  std::string what =
      str_cat(name(), " recv of ", t.bytes(), " bytes (", dtype_name(t.dtype()), ") from rank ", peer);
  check_device(what, t, "tensor");
  check_p2p(what, peer, tag, rank(), size());
  WireType w = wire_type(t.dtype());
  return launch(what, {{CommOpKind::Recv, peer, tag, int64_t(t.bytes())}}, [&](NcclState& s, cudaStream_t st) {
    if (t.numel() == 0) return;
    s.settle_locked(ncclRecv(t.raw(), w.count(t.numel()), w.type, peer, s.comm, st), what);
  });
}

WorkPtr NcclCommunicator::sendrecv_async(const Tensor& send, int send_peer, Tensor recv, int recv_peer) {
  std::string what = str_cat(name(), " sendrecv of ", send.bytes(), " bytes to rank ", send_peer, " and ", recv.bytes(),
                             " bytes from rank ", recv_peer);
  check_device(what, send, "send tensor");
  check_device(what, recv, "receive tensor");
  check_peer(what, send_peer, size());
  check_peer(what, recv_peer, size());
  if (overlaps(send, recv)) fail(ErrorKind::Comm, what, ": the send and receive buffers overlap");
  WireType ws = wire_type(send.dtype()), wr = wire_type(recv.dtype());
  // Recorded as its two halves (NCCL matches them by order; the tag is -1).
  const std::vector<NcclTraceOp> ops = {{CommOpKind::Send, send_peer, -1, int64_t(send.bytes())},
                                        {CommOpKind::Recv, recv_peer, -1, int64_t(recv.bytes())}};
  return launch(what, ops, [&](NcclState& s, cudaStream_t st) {
    group_call(s, what, [&] {
      if (send.numel() > 0) {
        ncclResult_t rc = ncclSend(send.raw(), ws.count(send.numel()), ws.type, send_peer, s.comm, st);
        if (is_failure(rc)) return rc;
      }
      if (recv.numel() > 0) return ncclRecv(recv.raw(), wr.count(recv.numel()), wr.type, recv_peer, s.comm, st);
      return ncclSuccess;
    });
  });
}

void NcclCommunicator::barrier() {
  all_reduce_async(Tensor(scratch_, {1}, DType::F32, Device::CUDA), ReduceOp::Sum)->wait();
}

bool NcclCommunicator::broken() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->broken;
}

void NcclCommunicator::abort(const std::string& reason) {
  NcclState& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.comm) return;
  CudaDeviceGuard guard(s.device);
  s.abort_locked(reason);
}

void NcclCommunicator::connect_neighbours() {
  const int n = size(), r = rank();
  if (n == 1) return;
  float* f = static_cast<float*>(scratch_);
  const Tensor send(f + 1, {1}, DType::F32, Device::CUDA), recv(f + 2, {1}, DType::F32, Device::CUDA);
  // Every rank sends forward and receives from behind, then the reverse: each
  // exchange is one group call on every rank, so all pairs connect together.
  sendrecv_async(send, (r + 1) % n, recv, (r + n - 1) % n)->wait();
  sendrecv_async(send, (r + n - 1) % n, recv, (r + 1) % n)->wait();
}

void NcclCommunicator::synchronize() {
  // Only the channel's own stream: no input-ready join, which would make the
  // host wait for the producer's work as well.
  NcclState& s = *state_;
  std::string what = str_cat(s.name, " synchronize");
  std::shared_ptr<NcclWork> w;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.broken) fail(ErrorKind::Comm, what, " refused: channel ", s.name, " is broken: ", s.broken_reason);
    CudaDeviceGuard guard(s.device);
    CudaEvent start(EventTiming::Enabled), done(EventTiming::Enabled);
    start.record(stream_);
    done.record(stream_);
    w = std::make_shared<NcclWork>(state_, what, now_seconds(), std::move(start), std::move(done));
  }
  w->wait();
}

std::unique_ptr<NcclCommunicator> make_nccl_group(Communicator& group, int device, cudaStream_t stream,
                                                  const CommOptions& opts) {
  return std::make_unique<NcclCommunicator>(group, device, stream, opts);
}

}  // namespace xirang
