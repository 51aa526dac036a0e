// core/clock.h: wall-clock timing for metrics, and how long the calling
// thread waited for a core.
//
//   Stopwatch sw;  ...;  double ms = sw.ms();
//   RunQueueWait w;  ...;  std::optional<double> waited = w.ms();   // runnable but not running
#pragma once

#include <chrono>
#include <optional>

namespace xirang {

inline double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

class Stopwatch {
 public:
  Stopwatch() : start_(now_seconds()) {}
  void restart() { start_ = now_seconds(); }
  double seconds() const { return now_seconds() - start_; }
  double ms() const { return 1e3 * seconds(); }

 private:
  double start_;
};

// The calling thread's total time runnable but waiting for a core, in
// seconds (Linux: /proc/thread-self/schedstat); nullopt where the kernel
// does not report it. On a machine whose cores are shared with other
// work, this is the time a step lost to it.
std::optional<double> thread_run_queue_wait_s();

// Run-queue wait of the constructing thread since construction (or restart);
// ms() must be called on the same thread.
class RunQueueWait {
 public:
  RunQueueWait() : start_(thread_run_queue_wait_s()) {}
  void restart() { start_ = thread_run_queue_wait_s(); }
  std::optional<double> ms() const {
    const std::optional<double> now = thread_run_queue_wait_s();
    if (!start_ || !now) return std::nullopt;
    return 1e3 * (*now - *start_);
  }

 private:
  std::optional<double> start_;
};

}  // namespace xirang
