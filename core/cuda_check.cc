#include "core/cuda_check.h"

#include <cstdlib>
#include <cstring>

namespace xirang {

bool cuda_sync_debug() {
  // A debugging switch, not behaviour: synchronize after every launch.
  static const bool on = [] {
    const char* v = std::getenv("XIRANG_CUDA_SYNC");
    return v && std::strcmp(v, "0") != 0;
  }();
  return on;
}

}  // namespace xirang
