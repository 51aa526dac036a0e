// runtime/preemption.h: stopping a run cleanly when the scheduler asks.
//
// Slurm and Kubernetes send SIGTERM some time before they kill a job, and
// Slurm's `--signal=USR1@SECONDS` sends SIGUSR1 ahead of the time limit.
// StopSignals catches both: the handler only records the signal (and
// restores the default action of both, so a second signal ends the process
// at once). The trainer asks once a step; the ranks agree through a max
// all-reduce over the world (the step's non-finite vote carries it), so they
// stop after the same step, save a checkpoint of it synchronously, print one
// line and exit with kPreemptedExitCode.
//
//   route_stop_signals();                      // first, before anything starts a thread
//   ...
//   StopSignals signals;                       // installs the handlers; the destructor restores the old ones
//   TrainerOptions o;
//   o.stop = &signals;                         // Trainer::run() returns early, result.preempted set
//   ...
//   return r.preempted ? kPreemptedExitCode : 0;
#pragma once

#include <string>

#include "comm/communicator.h"

namespace xirang {

// 75, EX_TEMPFAIL in sysexits.h: the run stopped on a signal after saving
// (when checkpoint.dir is set); run it again with checkpoint.resume=auto to continue.
constexpr int kPreemptedExitCode = 75;

// Where a stop request comes from; the trainer polls it once a step.
class StopSource {
 public:
  virtual ~StopSource() = default;
  // The signal number received by this process (0: none). Async-signal-safe to set, cheap to read.
  virtual int pending() const = 0;
};

// Sends SIGTERM and SIGUSR1 to a thread of their own for the rest of the
// process: blocks both in the calling thread, and so in every thread started
// from it afterwards (MPI's, OpenMP's, the channels' workers), and starts one
// thread, "xirang-signals", that does nothing but take them. Call it first,
// before anything starts a thread (the train command does); calling it again
// does nothing. A thread that already exists keeps taking them: it warns
// when it finds one (the pthreads build of OpenBLAS starts its threads
// before main). Why: a handler runs on the stack of the thread the kernel
// picks, and while oneDNN 2.x's JIT sgemm kernels run they point the stack
// pointer into a heap buffer (oneDNN issue 4845, mended after 3.11.1), so a
// signal taken by a computing thread writes its frame over the heap. Compute
// and communication threads also never see a system call cut short by a stop
// signal. Until a StopSignals is made, and after it is gone, both signals end
// the process as by default.
void route_stop_signals();

// How many of this process's threads take SIGTERM or SIGUSR1 (do not block
// both); after route_stop_signals, 1 (the catcher) unless a thread predates it.
int threads_taking_stop_signals();

// Installs handlers for SIGTERM and SIGUSR1. One StopSignals at a time per process.
class StopSignals final : public StopSource {
 public:
  StopSignals();
  ~StopSignals() override;
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int pending() const override;
};

// What the ranks agreed on at a step boundary.
struct StopRequest {
  int signal = 0;  // the largest signal number any rank received (0: no rank received one)
  int rank = -1;   // the highest world rank that received it
  explicit operator bool() const { return signal != 0; }
};

// The stop vote: every rank's entry (stop_vote) goes into a max all-reduce
// over the world at the same step boundary, and stop_of reads the result.
// The trainer carries it in the step's non-finite vote, so the check costs
// no communication of its own. `source` may be null: the rank then
// contributes nothing but still takes part.
double stop_vote(const StopSource* source, int world_rank);
StopRequest stop_of(double reduced_vote);

// "SIGTERM", "SIGUSR1", else "signal N".
std::string signal_name(int signal);

}  // namespace xirang
