// main() of the single-process test binaries: GoogleTest with one OpenMP
// thread per test process, unless OMP_NUM_THREADS says otherwise. ctest
// runs tests side by side on a machine with few cores, and OpenMP's idle
// workers spin before they sleep, taking the cores from the BLAS threads
// (which keep their default count, so matrix products round as in a normal
// run). Tests that need several OpenMP threads set them themselves.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdlib>

int main(int argc, char** argv) {
  if (!std::getenv("OMP_NUM_THREADS")) omp_set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
