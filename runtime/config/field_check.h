// runtime/config/field_check.h: the rule one config value must meet on its
// own, as a column of its schema row (runtime/config/config.cc).
//
// A rule that reads one field is data beside the field's key, not a line in
// validate.cc: validate() checks every row's column in schema order, then
// the rules between fields. Each check returns "" or the whole message,
// naming the key, the value and the rule:
//
//   {"steps", &t.steps, AtLeast{1}}                  // "train.steps=0 must be >= 1"
//   {"beta1", &t.beta1, Within{0, 1, Ends::ClosedOpen}}  // "train.beta1=1 must be in [0, 1)"
//   {"job", &m.job, NotEmpty{"it names the job in exported metrics"}}
//
// Comparisons are written as !(ok) so that a NaN set from code fails too.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

namespace xirang {

// value >= min; `why` follows the rule in the message (" (0 disables it)").
struct AtLeast {
  double min;
  const char* why = "";
};
// value > min.
struct Above {
  double min;
  const char* why = "";
};
// value > 0.
inline constexpr Above Positive{0};

// Which ends of a Within range belong to it: [lo, hi], [lo, hi), (lo, hi], (lo, hi).
enum class Ends { Closed, ClosedOpen, OpenClosed, Open };
// lo <(=) value <(=) hi. On an integer field a closed range of two values reads "must be 0 or 1".
struct Within {
  double lo, hi;
  Ends ends = Ends::Closed;
};

// Text that must not be empty: "key is empty: why".
struct NotEmpty {
  const char* why;
};

// Any other rule on one text value (a HOST:PORT, a known name): "" or the message.
struct TextRule {
  std::string (*problem)(std::string_view key, const std::string& value);
};

// A TextRule: "" for empty text (none) or "HOST:PORT" with a port in 1..65535.
std::string host_port_problem(std::string_view key, const std::string& value);

// One schema row's rule; std::monostate: none.
using FieldCheck = std::variant<std::monostate, AtLeast, Above, Within, NotEmpty, TextRule>;

// "" when the value meets the rule, else the message. A numeric rule on a
// text value (or the reverse) is a schema bug: ErrorKind::Internal.
std::string field_problem(const FieldCheck& check, std::string_view key, int64_t value);
std::string field_problem(const FieldCheck& check, std::string_view key, double value);
std::string field_problem(const FieldCheck& check, std::string_view key, const std::string& text);

}  // namespace xirang
