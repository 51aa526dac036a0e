#include "comm/communicator.h"

// The interface is header-only today; this unit anchors the comm library so
// that backends (MPI, NCCL) can be added as sources beside it.
namespace xirang {}
