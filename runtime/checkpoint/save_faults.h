// runtime/checkpoint/save_faults.h: the faults a checkpoint save can be
// made to suffer, for the fault tests (runtime/faults.h's FaultInjector
// picks them from faults.* and hands them over as this plain struct).
//
//   SaveFaults f = faults.save_faults();            // {kill_step, io_error_step, rank}
//   if (f.kills(steps_done)) f.kill(steps_done);     // the saver, halfway through its file
//   if (f.fails(steps_done)) f.fail_write(steps_done, path);
#pragma once

#include <cstdint>
#include <string>

namespace xirang {

struct SaveFaults {
  int64_t kill_step = -1;      // this rank dies halfway through its file of this step's checkpoint (-1: never)
  int64_t io_error_step = -1;  // this rank's write of this step's checkpoint fails there with EIO (-1: never)
  int rank = 0;                // the world rank, for the messages

  bool kills(int64_t steps_done) const { return steps_done == kill_step; }
  bool fails(int64_t steps_done) const { return steps_done == io_error_step; }
  // Says so on stderr and dies (SIGKILL). Thread-safe: the saver thread calls it.
  [[noreturn]] void kill(int64_t steps_done) const;
  // Says so on stderr and throws the Checkpoint error a write failing with
  // EIO gives, naming `path`. Thread-safe.
  [[noreturn]] void fail_write(int64_t steps_done, const std::string& path) const;
};

}  // namespace xirang
