// NcclWork: one NCCL operation's handle (see comm/nccl_communicator.h).
#include <cuda_runtime.h>

#include <utility>

#include "comm/nccl_state.h"
#include "core/cuda_check.h"

namespace xirang {

using nccl_detail::Backoff;
using nccl_detail::is_failure;

NcclWork::NcclWork(std::shared_ptr<NcclState> state, std::string what, double submitted_s, CudaEvent start,
                   CudaEvent done, std::vector<uint64_t> trace_ids)
    : state_(std::move(state)),
      what_(std::move(what)),
      submitted_s_(submitted_s),
      start_(std::move(start)),
      done_(std::move(done)),
      trace_ids_(std::move(trace_ids)) {}

bool NcclWork::poll() {
  if (finished_) return true;
  cudaError_t q = cudaEventQuery(done_.get());
  if (q == cudaErrorNotReady) cudaGetLastError();  // see CudaEvent::query
  std::string failure;
  bool timed_out = false;
  {
    NcclState& s = *state_;
    std::lock_guard<std::mutex> lk(s.mu);
    if (q == cudaSuccess) {
      // After an abort NCCL's kernels stop early, so an operation that
      // "completed" on a broken channel may hold partial data.
      if (s.broken)
        failure = str_cat(what_, " cannot be trusted: channel ", s.name, " broke before it was seen to complete: ",
                          s.broken_reason);
    } else if (q != cudaErrorNotReady) {
      failure = str_cat(what_, " failed: CUDA: ", cudaGetErrorString(q), " ", s.where());
      s.abort_locked(failure);
    } else {
      std::string async = s.async_error_locked();
      if (!async.empty()) {
        failure = str_cat(what_, " failed: ", async);
      } else if (s.broken) {
        failure = str_cat(what_, " abandoned: channel ", s.name, " is broken: ", s.broken_reason);
      } else if (now_seconds() - submitted_s_ > s.opts.timeout_s) {
        failure = str_cat(what_, " did not complete within ", s.opts.timeout_s,
                          " s: a peer rank may have died or stopped answering ", s.where(),
                          "; the NCCL communicator was aborted");
        s.abort_locked(failure);
        timed_out = true;
      } else {
        return false;
      }
    }
  }
  finished_ = true;
  if (CommTrace* trace = state_->opts.trace) {
    for (uint64_t id : trace_ids_) trace->completed(id, failure.empty(), now_seconds());
    // Like the MPI channels: the ring goes to disk once per process, for `xirang diagnose`.
    if (timed_out) {
      const std::string path = trace->dump(failure);
      if (!path.empty())
        failure += str_cat("; recent operations in ", path, " (`xirang diagnose ", trace->dump_dir(),
                           "` compares the ranks' files)");
    }
  }
  if (!failure.empty()) error_ = std::make_exception_ptr(Error(ErrorKind::Comm, failure));
  return true;
}

void NcclWork::wait() {
  Backoff backoff;
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (poll()) {
        if (error_) std::rethrow_exception(error_);
        return;
      }
    }
    backoff.pause();
  }
}

bool NcclWork::test() {
  std::lock_guard<std::mutex> lk(mu_);
  return poll();
}

double NcclWork::duration_ms() const {
  // Asked only once both have completed: on an incomplete event
  // cudaEventElapsedTime fails. A failed operation reports its error in
  // wait(), not here.
  if (cudaEventQuery(start_.get()) != cudaSuccess || cudaEventQuery(done_.get()) != cudaSuccess) {
    cudaGetLastError();  // see CudaEvent::query
    return 0;
  }
  float ms = 0;
  if (cudaEventElapsedTime(&ms, start_.get(), done_.get()) != cudaSuccess) return 0;
  return ms;
}

void NcclWork::wait_on(cudaStream_t stream) const { stream_wait(stream, done_); }

void join_on_stream(Work& work, cudaStream_t stream) {
  if (auto* nccl = dynamic_cast<NcclWork*>(&work)) {
    nccl->wait_on(stream);
    return;
  }
  work.wait();
}

}  // namespace xirang
