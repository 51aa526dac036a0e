// comm/nccl_state.h: what NcclCommunicator and its NcclWork handles share
// (private to comm/: nccl_communicator.cc and nccl_work.cc), and the host
// polling schedule of their waits.
#pragma once

#include <nccl.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "comm/nccl_check.h"
#include "comm/nccl_communicator.h"
#include "core/clock.h"
#include "core/error.h"

namespace xirang {

namespace nccl_detail {

// Host polling schedule of wait() and of set-up: yield for a moment (the
// event is usually just about to complete), then sleep with a growing
// backoff, up to 1 ms once nothing has happened for 20 ms. A host wait is
// rare on the hot path, so its latency matters less than leaving the cores
// to the other threads.
inline constexpr double kSpinSeconds = 50e-6;
inline constexpr double kLongWaitSeconds = 20e-3;
inline constexpr std::chrono::microseconds kMinBackoff{20};
inline constexpr std::chrono::microseconds kMaxBackoff{200};
inline constexpr std::chrono::microseconds kLongWaitBackoff{1000};

class Backoff {
 public:
  void pause() {
    double waited = now_seconds() - start_;
    if (waited < kSpinSeconds) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(2 * sleep_, waited < kLongWaitSeconds ? kMaxBackoff : kLongWaitBackoff);
  }

 private:
  double start_ = now_seconds();
  std::chrono::microseconds sleep_ = kMinBackoff;
};

inline bool is_failure(ncclResult_t rc) { return rc != ncclSuccess && rc != ncclInProgress; }

}  // namespace nccl_detail

// What the channel and its Work handles share. Every NCCL call on `comm`
// happens under `mu`, so the handle is used by one thread at a time and the
// abort happens once.
struct NcclState {
  std::mutex mu;
  ncclComm_t comm = nullptr;  // null after destruction or abort
  std::string name;
  int rank = 0, size = 1, device = 0;
  CommOptions opts;
  bool broken = false;  // an operation failed or timed out; the communicator was aborted
  std::string broken_reason;
  // This channel in opts.trace, and its counts of collectives and of point-to-point operations.
  int trace_channel = -1;
  uint64_t collectives = 0, p2p = 0;

  std::string where() const {
    return str_cat("(this is rank ", rank, " of ", size, " in group ", name, ", NCCL on CUDA device ", device, ")");
  }
  std::string nccl_message(ncclResult_t rc) const {
    const char* last = ncclGetLastError(comm);
    return str_cat(ncclGetErrorString(rc), last && *last ? str_cat(" (", last, ")") : std::string());
  }

  // The rest runs under mu.

  // Ends the NCCL communicator: its kernels stop, its peers' operations with
  // this rank fail or time out. The channel refuses all later work.
  void abort_locked(const std::string& reason) {
    if (!broken) {
      broken = true;
      broken_reason = reason;
    }
    if (comm) {
      ncclCommAbort(comm);
      comm = nullptr;
    }
  }

  // The communicator is non-blocking, so a call may return ncclInProgress
  // before its work is queued on the stream (set-up, and the connection
  // set-up NCCL does lazily at a first launch, both wait for peers). Polls
  // until NCCL is done with it: a dead peer then ends in a timeout and a
  // clean error instead of a host thread stuck inside NCCL forever. Throws
  // ErrorKind::Comm (after aborting) on failure or timeout.
  void settle_locked(ncclResult_t rc, const std::string& what) {
    double start = now_seconds();
    nccl_detail::Backoff backoff;
    while (rc == ncclInProgress && comm) {
      if (now_seconds() - start > opts.timeout_s) {
        std::string msg = str_cat(what, " was not accepted by NCCL within ", opts.timeout_s,
                                  " s: a peer rank may have died or stopped answering ", where());
        abort_locked(msg);
        fail(ErrorKind::Comm, msg, "; the NCCL communicator was aborted");
      }
      backoff.pause();
      ncclResult_t state = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(comm, &state);
      rc = q != ncclSuccess ? q : state;
    }
    if (rc == ncclSuccess) return;
    std::string msg = str_cat(what, " failed: NCCL: ", nccl_message(rc), " ", where());
    abort_locked(msg);
    fail(ErrorKind::Comm, msg, "; the NCCL communicator was aborted");
  }

  // An asynchronous error NCCL has seen on the channel (a network failure, a
  // peer that went away), or "" when there is none. Aborts on one.
  std::string async_error_locked() {
    if (!comm) return "";
    ncclResult_t state = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) state = q;
    if (!nccl_detail::is_failure(state)) return "";
    std::string msg = str_cat("NCCL reported an error on channel ", name, ": ", nccl_message(state), " ", where());
    abort_locked(msg);
    return msg;
  }
};

}  // namespace xirang
