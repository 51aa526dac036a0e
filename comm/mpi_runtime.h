// comm/mpi_runtime.h: process-wide MPI set-up.
//
// One MpiRuntime lives in main() of a multi-rank program. It initialises MPI
// with MPI_THREAD_MULTIPLE (communication threads run beside the compute
// thread) and finalises it on destruction. After an unrecoverable error
// (a timed-out collective, a dead peer) the program calls abort_world(),
// which ends every rank of the job instead of leaving them hanging.
//
//   MpiRuntime mpi(&argc, &argv);
//   auto grid = ProcessGrid::create_mpi(shape, options);
#pragma once

namespace xirang {

class MpiRuntime {
 public:
  // Throws ErrorKind::Comm when the library cannot give MPI_THREAD_MULTIPLE.
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }
  // Ends every rank of the job with `code` (MPI_Abort on MPI_COMM_WORLD).
  [[noreturn]] static void abort_world(int code);
  // True when MPI has been initialised and not finalised in this process.
  static bool active();

 private:
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace xirang
