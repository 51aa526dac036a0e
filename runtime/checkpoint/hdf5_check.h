// runtime/checkpoint/hdf5_check.h: the HDF5 call check, RAII handles and the attribute
// helpers the checkpoint code (runtime/checkpoint_*.cc) shares.
//
// HDF5 reports failure with a negative return value and keeps its own
// message on a per-thread error stack; XR_HDF5_CHECK turns the failure into
// a Library error carrying the call, file:line and that stack as one line.
// The checkpoint code catches those and rethrows them as Checkpoint errors
// that name the file and the tensor.
//
//   Hdf5Scope scope;  // first line of every public checkpoint operation
//   H5Id file(XR_HDF5_ID(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)), H5Fclose);
//   XR_HDF5_CHECK(H5Dread(dset, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, buf));
//   int64_t rank = read_attr_i64(file, "rank");
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"

namespace xirang {

// The current thread's HDF5 error stack, outermost call first, as one line
// ("H5Fopen: unable to open file; H5F_open: truncated file: eof = ..."). It
// must run right after the failing call: the next HDF5 call clears the stack.
std::string hdf5_error_message();

// hid_t-returning calls: the id, or a Library error (ids are negative on failure).
inline hid_t hdf5_checked_id(hid_t id, const char* call, const char* file, int line) {
  if (id < 0) fail_library("HDF5", file, line, call, hdf5_error_message());
  return id;
}

}  // namespace xirang

// herr_t / htri_t / hssize_t calls: negative is failure.
#define XR_HDF5_CHECK(call) XR_LIB_CHECK("HDF5", call, rc >= 0, ::xirang::hdf5_error_message())
#define XR_HDF5_ID(call) ::xirang::hdf5_checked_id((call), #call, __FILE__, __LINE__)

namespace xirang {

// Held for the duration of each public checkpoint operation. It serializes
// HDF5 use within the process (a serial HDF5 build is not thread-safe, and
// the trainer may write a checkpoint from a background thread), and turns off
// HDF5's default printing of its error stack to stderr: the errors we throw
// carry that text instead. The printing switch is per thread in thread-safe
// builds, hence the thread_local flag.
class Hdf5Scope {
 public:
  Hdf5Scope() : lock_(mutex()) {
    // A file whose H5Fclose failed (a flush onto a full disk) stays in
    // HDF5's id table half destroyed, and the library's exit handler would
    // close it again and crash: the handler is turned off before HDF5 first
    // initialises (every file is closed explicitly; nothing is left to flush).
    static const bool no_exit_handler = H5dont_atexit() >= 0;
    (void)no_exit_handler;
    thread_local bool quiet = false;
    if (!quiet) {
      H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
      quiet = true;
    }
  }

 private:
  static std::recursive_mutex& mutex() {
    static std::recursive_mutex m;
    return m;
  }
  std::lock_guard<std::recursive_mutex> lock_;
};

// Owns one HDF5 id and closes it with the matching H5*close. Destruction
// ignores a close failure (it may run while an error unwinds); close() reports it.
class H5Id {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Id() = default;
  H5Id(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  H5Id(H5Id&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = -1; }
  H5Id& operator=(H5Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      closer_ = o.closer_;
      o.id_ = -1;
    }
    return *this;
  }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  ~H5Id() { reset(); }

  operator hid_t() const { return id_; }
  bool valid() const { return id_ >= 0; }
  hid_t release() {
    hid_t id = id_;
    id_ = -1;
    return id;
  }
  void reset() {
    if (id_ >= 0) closer_(id_);
    id_ = -1;
  }
  void close() {
    if (id_ < 0) return;
    hid_t id = id_;
    id_ = -1;
    XR_HDF5_CHECK(closer_(id));
  }

 private:
  hid_t id_ = -1;
  Closer closer_ = nullptr;
};

// Call inside a catch block: rethrows the current exception as a Checkpoint
// error prefixed with `context` (which names the file, and the tensor where
// there is one). Checkpoint and Internal errors pass through unchanged.
[[noreturn]] void rethrow_as_checkpoint(const std::string& context);

// fsync of a file, or of a directory (which makes renames inside it
// durable); a Checkpoint error naming the path on failure.
void sync_path(const std::string& path, bool directory);

// Attributes on a file, group or dataset. Writers create them (fixed-size
// little-endian types, fixed-length strings); readers check the type class
// and throw a Library error naming the attribute when it is absent or of
// another kind.
void write_attr_str(hid_t obj, const char* name, const std::string& value);
void write_attr_i64(hid_t obj, const char* name, int64_t value);
void write_attr_i64s(hid_t obj, const char* name, const std::vector<int64_t>& values);
void write_attr_f64(hid_t obj, const char* name, double value);
void write_attr_u32s(hid_t obj, const char* name, const std::vector<uint32_t>& values);

bool has_attr(hid_t obj, const char* name);
bool attr_is_integer(hid_t obj, const char* name);  // integer class (else float, string...)
std::string read_attr_str(hid_t obj, const char* name);
int64_t read_attr_i64(hid_t obj, const char* name);
std::vector<int64_t> read_attr_i64s(hid_t obj, const char* name);
double read_attr_f64(hid_t obj, const char* name);
std::vector<uint32_t> read_attr_u32s(hid_t obj, const char* name);
// Names of the attributes of `obj`, in name order.
std::vector<std::string> attr_names(hid_t obj);

}  // namespace xirang
