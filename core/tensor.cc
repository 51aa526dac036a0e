#include "core/tensor.h"

#include <sstream>

namespace xirang {

const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

Shape::Shape(std::initializer_list<int64_t> dims) {
  XR_CHECK(dims.size() <= kMaxRank, "rank ", dims.size(), " exceeds ", kMaxRank);
  for (int64_t d : dims) dims_[rank_++] = d;
}

void Shape::push_back(int64_t d) {
  XR_CHECK(rank_ < kMaxRank, "rank exceeds ", kMaxRank);
  dims_[rank_++] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < rank_; ++i) os << (i ? ", " : "") << dims_[i];
  os << ")";
  return os.str();
}

Tensor Tensor::view(Shape shape) const {
  if (shape.numel() != numel())
    fail(ErrorKind::Shape, "cannot view ", str(), " as ", shape.str(), ": element counts differ");
  return Tensor(data_, shape, dtype_, device_);
}

Tensor Tensor::flat2d() const {
  XR_CHECK(rank() >= 1, "flat2d of a scalar");
  int64_t cols = size(-1);
  return view({cols ? numel() / cols : 0, cols});
}

Tensor Tensor::flat() const { return view({numel()}); }

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  XR_CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= size(0), "slice [", begin, ", ", end, ") of ", str());
  Shape s = shape_;
  s[0] = end - begin;
  int64_t row = size(0) ? numel() / size(0) : 0;
  return Tensor(static_cast<char*>(data_) + begin * row * int64_t(dtype_size(dtype_)), s, dtype_, device_);
}

Tensor Tensor::flat_range(int64_t begin, int64_t end) const {
  XR_CHECK(0 <= begin && begin <= end && end <= numel(), "range [", begin, ", ", end, ") of ", str());
  return Tensor(static_cast<char*>(data_) + begin * int64_t(dtype_size(dtype_)), {end - begin}, dtype_, device_);
}

std::string Tensor::str() const { return str_cat(dtype_name(dtype_), shape_.str(), " ", device_name(device_)); }

void check_same_shape(const char* op, const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) fail(ErrorKind::Shape, op, ": shapes differ: ", a.shape().str(), " vs ", b.shape().str());
}

void check_shape(const char* op, const char* what, const Tensor& t, const Shape& expected) {
  if (t.shape() != expected)
    fail(ErrorKind::Shape, op, ": ", what, " has shape ", t.shape().str(), ", expected ", expected.str());
}

void check_dtype(const char* op, const char* what, const Tensor& t, DType expected) {
  if (t.dtype() != expected)
    fail(ErrorKind::Shape, op, ": ", what, " has dtype ", dtype_name(t.dtype()), ", expected ", dtype_name(expected));
}

}  // namespace xirang
