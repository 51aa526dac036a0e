// Foreign model file adapters: the lookup and the layout conversions (models/file_adapter.h).
#include "models/file_adapter.h"

#include <algorithm>

#include "core/error.h"
#include "models/model.h"

namespace xirang {

namespace {

// (rows, cols) row-major -> (cols, rows).
std::vector<float> transposed(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

// Elements per row of a tensor of shape s (rank >= 1).
int64_t row_elements(const Shape& s) { return s[0] == 0 ? 0 : s.numel() / s[0]; }

}  // namespace

const ModelFileAdapter& file_adapter(const ModelArch& arch) {
  if (!arch.files)
    fail(ErrorKind::Config, "model.arch=", arch.name,
         " has no adapter for Hugging Face or llm.c model files: it cannot be exported to or imported from them");
  return *arch.files;
}

bool foreign_accepts(const ForeignTensor& t, const Shape& ours, const Shape& stored) {
  return stored == t.shape || (t.layout == ForeignLayout::RealRows && stored == ours);
}

std::vector<float> to_foreign(const ForeignTensor& t, const Shape& ours, std::vector<float> values) {
  XR_CHECK(int64_t(values.size()) == ours.numel(), values.size(), " values for a parameter of shape ", ours.str());
  switch (t.layout) {
    case ForeignLayout::Same: return values;
    case ForeignLayout::Transposed: return transposed(values, ours[0], ours[1]);
    case ForeignLayout::RealRows:
      values.resize(size_t(t.real_rows) * size_t(row_elements(ours)));  // the real rows come first
      return values;
  }
  return values;
}

void from_foreign(const ForeignTensor& t, const Shape& stored, std::vector<float> values, const Shape& ours_shape,
                  std::vector<float>& ours) {
  XR_CHECK(int64_t(values.size()) == stored.numel(), values.size(), " values stored as ", stored.str());
  XR_CHECK(int64_t(ours.size()) == ours_shape.numel(), ours.size(), " values for a parameter of shape ",
           ours_shape.str());
  switch (t.layout) {
    case ForeignLayout::Same: ours = std::move(values); break;
    case ForeignLayout::Transposed: ours = transposed(values, stored[0], stored[1]); break;
    case ForeignLayout::RealRows: {
      const size_t real = size_t(t.real_rows) * size_t(row_elements(ours_shape));
      XR_CHECK(real <= values.size() && real <= ours.size(), "stored ", stored.str(), " has fewer than ", t.real_rows,
               " rows");
      std::copy(values.begin(), values.begin() + ptrdiff_t(real), ours.begin());  // our padding rows stay zero
      break;
    }
  }
  XR_CHECK(ours.size() == size_t(ours_shape.numel()), "stored ", stored.str(), " does not fill ", ours_shape.str());
}

}  // namespace xirang
