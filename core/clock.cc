#include "core/clock.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace xirang {

// schedstat holds three numbers: time on a core (ns), time runnable on a run
// queue (ns), and the number of timeslices. One read of a small proc file,
// a few microseconds: cheap enough for once per step.
std::optional<double> thread_run_queue_wait_s() {
  const int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[128];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  buf[n] = '\0';
  char* end = nullptr;
  std::strtoull(buf, &end, 10);
  if (end == buf) return std::nullopt;
  char* end2 = nullptr;
  const unsigned long long waited = std::strtoull(end, &end2, 10);
  if (end2 == end) return std::nullopt;
  return 1e-9 * double(waited);
}

}  // namespace xirang
