// core/arena.h: arenas (allocate once, carve tensors) and the memory plan.
//
// Every long-lived buffer (parameters, gradients, optimizer state,
// activations, workspaces) is carved from an Arena that makes one allocation
// at start-up. Fresh pages are slow to touch and freed memory goes back to the
// host, so nothing is allocated or freed inside the training loop.
//
// Sizing is done by running the same carving code twice: first against a
// measuring arena (no memory, counts bytes), then against the real one.
//
//   Arena probe = Arena::measuring("activations");
//   layout_activations(probe);                      // alloc() calls only count
//   plan.add("activations", probe.used());
//   plan.check_limit(limit_bytes);                  // throws a clear Memory error
//   Arena acts("activations", probe.used(), Device::CPU);
//   layout_activations(acts);                       // now with real memory
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace xirang {

class Arena {
 public:
  static constexpr size_t kAlignment = 256;  // enough for AVX-512 and CUDA vector loads

  Arena() = default;
  // Allocates `capacity` bytes on `device` once. Host memory is pre-faulted.
  Arena(std::string name, size_t capacity, Device device = Device::CPU);
  // An arena without memory that only counts what alloc() would take.
  static Arena measuring(std::string name, Device device = Device::CPU);
  ~Arena();
  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&& other) noexcept;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Carves a tensor; throws ErrorKind::Memory naming the arena and `what` when it does not fit.
  Tensor alloc(const Shape& shape, DType dtype, std::string_view what);
  bool is_measuring() const { return measuring_; }
  size_t used() const { return used_; }
  size_t capacity() const { return capacity_; }
  const std::string& name() const { return name_; }
  Device device() const { return device_; }
  void* base() const { return base_; }
  // Forgets all carved tensors (their memory is reused by later allocs).
  void reset() { used_ = 0; }

 private:
  std::string name_;
  void* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  Device device_ = Device::CPU;
  bool measuring_ = false;
};

// The memory a run needs, by category, printed at start-up and checked
// against a configured limit before anything is allocated.
class MemoryPlan {
 public:
  struct Item {
    std::string category;  // "parameters", "gradients", "optimizer state", "activations", ...
    std::string detail;    // how it was sized, e.g. "124.4M x f32"
    size_t bytes;
  };
  void add(std::string category, size_t bytes, std::string detail = "");
  size_t total() const;
  size_t bytes_of(std::string_view category) const;
  const std::vector<Item>& items() const { return items_; }
  // A table, one line per category and a total.
  std::string table(std::string_view title) const;
  // Throws ErrorKind::Memory, naming the total, the limit and the largest item, when total() > limit.
  void check_limit(size_t limit_bytes, std::string_view limit_key) const;

 private:
  std::vector<Item> items_;
};

std::string format_bytes(size_t bytes);  // "1.25 GiB"

}  // namespace xirang
