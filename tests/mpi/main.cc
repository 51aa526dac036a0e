// main() of the multi-rank tests: every rank runs every test (the tests are
// collective, so all ranks must run the same ones in the same order); rank 0
// prints the usual report, the other ranks print only their failures, and
// the job fails when any rank failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "comm/mpi_runtime.h"

namespace {

// Failures of ranks other than 0, which would otherwise go unseen.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // The test's name is kept from OnTestStart: asking gtest for the current
  // test inside OnTestPartResult deadlocks on gtest's own mutex.
  void OnTestStart(const ::testing::TestInfo& t) override {
    test_ = std::string(t.test_suite_name()) + "." + t.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: %s\n", rank_, test_.c_str(), r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.message());
  }

 private:
  int rank_;
  std::string test_ = "(no test)";
};

}  // namespace

int main(int argc, char** argv) {
  xirang::MpiRuntime mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (mpi.world_rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(mpi.world_rank()));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (mpi.world_rank() == 0 && any_failed && !failed) std::fprintf(stderr, "a rank other than 0 failed (see above)\n");
  return any_failed;
}
