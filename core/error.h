// core/error.h: the project's error types and checking macros.
//
// Library code never exits: it throws a typed xirang::Error whose message
// already names what went wrong, where, and what was expected. Only tools/
// catches and turns the message into one line on stderr and a non-zero exit.
//
//   XR_CHECK(n % tp == 0, "n_head ", n, " is not divisible by tp ", tp);
//   XR_LIB_CHECK("MPI", MPI_Send(...), rc == MPI_SUCCESS, mpi_error_string(rc));
//
// Checks are always compiled in: they never depend on NDEBUG, and the checked
// expression is evaluated exactly once.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace xirang {

// What kind of failure an error is; tools/ maps this to the message prefix.
enum class ErrorKind { Internal, Config, Data, Shape, Memory, Checkpoint, Comm, Library, Usage };

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// Concatenates any streamable values into one string.
template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// Throws an Error of `kind` whose message is the concatenation of args.
template <class... Args>
[[noreturn]] void fail(ErrorKind kind, Args&&... args) {
  throw Error(kind, str_cat(std::forward<Args>(args)...));
}

[[noreturn]] void fail_check(const char* file, int line, const char* expr, const std::string& msg);
[[noreturn]] void fail_library(const char* lib, const char* file, int line, const char* call,
                               const std::string& lib_message);

}  // namespace xirang

// Internal invariant: a failure here is a bug or a misuse of an API.
#define XR_CHECK(cond, ...)                                                     \
  do {                                                                          \
    if (!(cond)) ::xirang::fail_check(__FILE__, __LINE__, #cond, ::xirang::str_cat(__VA_ARGS__)); \
  } while (0)

// Generic library-call check. `call` is evaluated once into `rc`; `ok` is an
// expression over rc; `message` (over rc) gives the library's own text.
#define XR_LIB_CHECK(lib, call, ok, message)                                    \
  do {                                                                          \
    auto rc = (call);                                                           \
    if (!(ok)) ::xirang::fail_library(lib, __FILE__, __LINE__, #call, (message)); \
  } while (0)
