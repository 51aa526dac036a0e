// Foreign model file adapters: the lookup and the layout conversions (models/file_adapter.h).
#include "models/file_adapter.h"

#include <algorithm>
#include <cmath>

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

Shape foreign_block(const ForeignTensor& t, const Shape& ours) {
  if (t.row_begin == 0 && t.row_end < 0) return ours;
  XR_CHECK(ours.rank() >= 1 && 0 <= t.row_begin && t.row_begin < t.row_end && t.row_end <= ours[0], "rows [",
           t.row_begin, ", ", t.row_end, ") of a parameter of shape ", ours.str());
  Shape block = ours;
  block[0] = t.row_end - t.row_begin;
  return block;
}

bool foreign_accepts(const ForeignTensor& t, const Shape& ours, const Shape& stored) {
  return stored == t.shape || (t.layout == ForeignLayout::RealRows && stored == foreign_block(t, ours));
}

std::vector<float> to_foreign(const ForeignTensor& t, const Shape& ours, std::vector<float> values) {
  XR_CHECK(int64_t(values.size()) == ours.numel(), values.size(), " values for a parameter of shape ", ours.str());
  const Shape block = foreign_block(t, ours);
  if (block != ours) {
    // The block's rows are consecutive in the row-major parameter.
    const int64_t per_row = row_elements(ours);
    values = std::vector<float>(values.begin() + ptrdiff_t(t.row_begin * per_row),
                                values.begin() + ptrdiff_t(t.row_begin * per_row + block.numel()));
  }
  switch (t.layout) {
    case ForeignLayout::Same: return values;
    case ForeignLayout::Transposed: return transposed(values, block[0], block[1]);
    case ForeignLayout::RealRows:
      values.resize(size_t(t.real_rows) * size_t(row_elements(block)));  // the real rows come first
      return values;
  }
  return values;
}

void from_foreign(const ForeignTensor& t, const Shape& stored, std::vector<float> values, const Shape& ours_shape,
                  std::vector<float>& ours) {
  XR_CHECK(int64_t(values.size()) == stored.numel(), values.size(), " values stored as ", stored.str());
  XR_CHECK(int64_t(ours.size()) == ours_shape.numel(), ours.size(), " values for a parameter of shape ",
           ours_shape.str());
  const Shape block = foreign_block(t, ours_shape);
  std::vector<float> mine(size_t(block.numel()), 0.0f);
  switch (t.layout) {
    case ForeignLayout::Same: mine = std::move(values); break;
    case ForeignLayout::Transposed: mine = transposed(values, stored[0], stored[1]); break;
    case ForeignLayout::RealRows: {
      const size_t real = size_t(t.real_rows) * size_t(row_elements(block));
      XR_CHECK(real <= values.size() && real <= mine.size(), "stored ", stored.str(), " has fewer than ", t.real_rows,
               " rows");
      std::copy(values.begin(), values.begin() + ptrdiff_t(real), mine.begin());  // our padding rows stay zero
      break;
    }
  }
  XR_CHECK(mine.size() == size_t(block.numel()), "stored ", stored.str(), " does not fill ", block.str());
  std::copy(mine.begin(), mine.end(), ours.begin() + ptrdiff_t(t.row_begin * row_elements(ours_shape)));
}

HfConfigCheck::HfConfigCheck(const std::string& text) {
  j_ = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j_.is_object()) problem_ = "it is not a JSON object";
}

std::string HfConfigCheck::model(const std::string& architecture, const std::string& model_type,
                                 const std::string& arch) const {
  if (!problem_.empty()) return problem_;
  const auto a = j_.find("architectures");
  if (a != j_.end() && !(a->is_array() && !a->empty() && (*a)[0] == architecture))
    return str_cat("architectures is ", a->dump(), ", a model other than the config's: model.arch=", arch, " reads ",
                   architecture);
  const auto t = j_.find("model_type");
  if (t != j_.end() && *t != model_type)
    return str_cat("model_type is ", t->dump(), ", a model other than the config's: model.arch=", arch, " reads \"",
                   model_type, "\"");
  return "";
}

std::string HfConfigCheck::integer(const char* field, int64_t want, const std::string& key,
                                   std::optional<int64_t> absent) const {
  const auto v = j_.find(field);
  if (v == j_.end()) {
    if (!absent || *absent == want) return "";
    return str_cat(field, " is absent (", *absent, ") but the config has ", key, "=", want);
  }
  if (!v->is_number_integer() || v->get<int64_t>() != want)
    return str_cat(field, " is ", v->dump(), " but the config has ", key, "=", want);
  return "";
}

std::string HfConfigCheck::number(const char* field, double want, const std::string& key,
                                  std::optional<double> absent) const {
  auto differs = [&](double x) { return std::abs(x - want) > 1e-9 * std::max(std::abs(x), std::abs(want)); };
  const auto v = j_.find(field);
  if (v == j_.end()) {
    if (!absent || !differs(*absent)) return "";
    return str_cat(field, " is absent (", *absent, ") but the config has ", key, "=", want);
  }
  if (!v->is_number() || differs(v->get<double>()))
    return str_cat(field, " is ", v->dump(), " but the config has ", key, "=", want);
  return "";
}

std::string HfConfigCheck::boolean(const char* field, bool want, const std::string& key,
                                   std::optional<bool> absent) const {
  const auto v = j_.find(field);
  if (v == j_.end()) {
    if (!absent || *absent == want) return "";
    return str_cat(field, " is absent (", *absent ? "true" : "false", ") but the config has ", key, "=",
                   want ? "true" : "false");
  }
  if (!v->is_boolean() || v->get<bool>() != want)
    return str_cat(field, " is ", v->dump(), " but the config has ", key, "=", want ? "true" : "false");
  return "";
}

std::string HfConfigCheck::text(const char* field, const std::string& want, const std::string& why) const {
  const auto v = j_.find(field);
  if (v == j_.end() || *v == want) return "";
  return str_cat(field, " is ", v->dump(), "; ", why);
}

}  // namespace xirang
