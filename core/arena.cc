#include "core/arena.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <iomanip>

#include "core/device_memory.h"

namespace xirang {

namespace {
size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
}  // namespace

Arena::Arena(std::string name, size_t capacity, Device device)
    : name_(std::move(name)), capacity_(align_up(capacity, kAlignment)), device_(device) {
  if (capacity_ == 0) return;
  base_ = device_alloc(device_, capacity_, name_);
}

Arena Arena::measuring(std::string name, Device device) {
  Arena a;
  a.name_ = std::move(name);
  a.device_ = device;
  a.measuring_ = true;
  return a;
}

Arena::~Arena() {
  if (base_) device_free(device_, base_);
}

Arena::Arena(Arena&& o) noexcept { *this = std::move(o); }

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    if (base_) device_free(device_, base_);
    name_ = std::move(o.name_);
    base_ = o.base_;
    capacity_ = o.capacity_;
    used_ = o.used_;
    device_ = o.device_;
    measuring_ = o.measuring_;
    o.base_ = nullptr;
    o.capacity_ = o.used_ = 0;
  }
  return *this;
}

Tensor Arena::alloc(const Shape& shape, DType dtype, std::string_view what) {
  size_t bytes = align_up(size_t(shape.numel()) * dtype_size(dtype), kAlignment);
  if (measuring_) {
    used_ += bytes;
    return Tensor(nullptr, shape, dtype, device_);
  }
  if (used_ + bytes > capacity_)
    fail(ErrorKind::Memory, "arena '", name_, "' is full: ", what, " needs ", format_bytes(bytes), " but only ",
         format_bytes(capacity_ - used_), " of ", format_bytes(capacity_), " is left");
  void* p = static_cast<char*>(base_) + used_;
  used_ += bytes;
  return Tensor(p, shape, dtype, device_);
}

void MemoryPlan::add(std::string category, size_t bytes, std::string detail) {
  for (auto& it : items_)
    if (it.category == category) {
      it.bytes += bytes;
      if (!detail.empty()) it.detail = it.detail.empty() ? detail : it.detail + "; " + detail;
      return;
    }
  items_.push_back({std::move(category), std::move(detail), bytes});
}

size_t MemoryPlan::total() const {
  size_t t = 0;
  for (auto& it : items_) t += it.bytes;
  return t;
}

size_t MemoryPlan::bytes_of(std::string_view category) const {
  for (auto& it : items_)
    if (it.category == category) return it.bytes;
  return 0;
}

std::string MemoryPlan::table(std::string_view title) const {
  std::ostringstream os;
  os << title << "\n";
  for (auto& it : items_) {
    os << "  " << std::left << std::setw(18) << it.category << std::right << std::setw(12) << format_bytes(it.bytes);
    if (!it.detail.empty()) os << "  " << it.detail;
    os << "\n";
  }
  os << "  " << std::left << std::setw(18) << "total" << std::right << std::setw(12) << format_bytes(total()) << "\n";
  return os.str();
}

void MemoryPlan::check_limit(size_t limit, std::string_view limit_key) const {
  if (limit == 0 || total() <= limit) return;
  const Item* largest = &items_.front();
  for (auto& it : items_)
    if (it.bytes > largest->bytes) largest = &it;
  fail(ErrorKind::Memory, "the memory plan needs ", format_bytes(total()), " but ", limit_key, " allows ",
       format_bytes(limit), " (largest part: ", largest->category, " ", format_bytes(largest->bytes),
       "); reduce train.micro_batch or model size, or raise ", limit_key);
}

std::string format_bytes(size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(u == 0 ? 0 : 2) << v << " " << units[u];
  return os.str();
}

}  // namespace xirang
