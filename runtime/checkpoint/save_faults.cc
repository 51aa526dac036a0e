#include "runtime/checkpoint/save_faults.h"

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace xirang {

void SaveFaults::kill(int64_t steps_done) const {
  std::fprintf(stderr, "rank %d: injecting fault 'kill_in_save' at step %lld\n", rank, (long long)steps_done);
  std::fflush(stderr);
  std::raise(SIGKILL);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // SIGKILL is never ignored; this keeps [[noreturn]] true
}

void SaveFaults::fail_write(int64_t steps_done, const std::string& path) const {
  std::fprintf(stderr, "rank %d: injecting fault 'io_error' at step %lld\n", rank, (long long)steps_done);
  std::fflush(stderr);
  fail(ErrorKind::Checkpoint, "write ", path, ": ", std::strerror(EIO), " (faults.kind=io_error)");
}

}  // namespace xirang
