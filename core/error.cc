#include "core/error.h"

namespace xirang {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::Internal: return "internal error";
    case ErrorKind::Config: return "config error";
    case ErrorKind::Data: return "data error";
    case ErrorKind::Shape: return "shape error";
    case ErrorKind::Memory: return "memory error";
    case ErrorKind::Checkpoint: return "checkpoint error";
    case ErrorKind::Comm: return "communication error";
    case ErrorKind::Library: return "library error";
    case ErrorKind::Usage: return "usage error";
  }
  return "error";
}

void fail_check(const char* file, int line, const char* expr, const std::string& msg) {
  throw Error(ErrorKind::Internal,
              str_cat(file, ":", line, ": check failed: ", expr, msg.empty() ? "" : ": ", msg));
}

void fail_library(const char* lib, const char* file, int line, const char* call,
                  const std::string& lib_message) {
  throw Error(ErrorKind::Library, str_cat(file, ":", line, ": ", lib, " call failed: ", call, ": ", lib_message));
}

}  // namespace xirang
