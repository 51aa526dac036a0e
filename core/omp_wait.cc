#include "core/omp_wait.h"

#include <unistd.h>

#include <cstdlib>

namespace xirang {

void restart_with_passive_omp_wait(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || !argv || !argv[0]) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: exec failed. The runtime keeps the policy it loaded with;
  // the variable stays set for the processes this one starts.
}

}  // namespace xirang
