// core/tensor.h: Tensor, a non-owning view of device or host memory.
//
// A Tensor is a pointer, a shape, a run-time dtype and a device. It owns
// nothing: memory comes from an Arena (core/arena.h) sized at start-up, so a
// Tensor is cheap to copy and pass by value. There is no autograd: layers
// write their backward passes by hand.
//
//   Tensor x = acts.alloc({B, T, C}, DType::F32, "ln1_out");
//   float* p = x.data<float>();          // checks the dtype
//   Tensor row = x.flat2d().slice(0, 3, 4); // rows [3, 4) of the (B*T, C) view
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace xirang {

enum class Device : uint8_t { CPU, CUDA };
const char* device_name(Device d);

// A shape of up to kMaxRank dimensions, row-major (last dimension fastest).
class Shape {
 public:
  static constexpr int kMaxRank = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t& operator[](int i) { return dims_[i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "(2, 3, 4)"
  void push_back(int64_t d);

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, Shape shape, DType dtype, Device device = Device::CPU)
      : data_(data), shape_(shape), dtype_(dtype), device_(device) {}

  bool defined() const { return data_ != nullptr; }
  void* raw() const { return data_; }
  template <class T>
  T* data() const;  // typed pointer; throws when T does not match dtype()
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t size(int dim) const { return shape_[dim < 0 ? dim + shape_.rank() : dim]; }
  int64_t numel() const { return shape_.numel(); }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  // Same memory, another shape with the same element count.
  Tensor view(Shape shape) const;
  // 2-D view (product of leading dims, last dim).
  Tensor flat2d() const;
  // 1-D view of all elements.
  Tensor flat() const;
  // Rows [begin, end) along dimension 0 (contiguous because row-major).
  Tensor slice(int64_t begin, int64_t end) const;
  // Element range [begin, end) of the flat view.
  Tensor flat_range(int64_t begin, int64_t end) const;
  std::string str() const;  // "f32(2, 3) cpu"

 private:
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

template <class T>
struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::F32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::F64; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::BF16; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::F16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::I32; };
template <> struct dtype_of<uint16_t> { static constexpr DType value = DType::U16; };
template <> struct dtype_of<uint32_t> { static constexpr DType value = DType::U32; };

template <class T>
T* Tensor::data() const {
  if (dtype_of<T>::value != dtype_)
    fail(ErrorKind::Shape, "tensor ", str(), " accessed as ", dtype_name(dtype_of<T>::value));
  return static_cast<T*>(data_);
}

// Shape and dtype agreement checks used at op boundaries; they name the op.
void check_same_shape(const char* op, const Tensor& a, const Tensor& b);
void check_shape(const char* op, const char* what, const Tensor& t, const Shape& expected);
void check_dtype(const char* op, const char* what, const Tensor& t, DType expected);

}  // namespace xirang
