// core/clock.h: wall-clock timing for metrics.
//
//   Stopwatch sw;  ...;  double ms = sw.ms();
#pragma once

#include <chrono>

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

}  // namespace xirang
