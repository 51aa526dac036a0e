#include "runtime/config/field_check.h"

#include "core/error.h"
#include "runtime/config/config_text.h"

namespace xirang {
namespace {

// A number as the message prints it: integers as integers, doubles as the
// emitted YAML writes them (so the message quotes what the file can say).
std::string number(double v, bool integer) { return integer ? std::to_string(int64_t(v)) : format_double(v); }

bool meets(const Within& w, double v) {
  const bool lo_ok = w.ends == Ends::Closed || w.ends == Ends::ClosedOpen ? v >= w.lo : v > w.lo;
  const bool hi_ok = w.ends == Ends::Closed || w.ends == Ends::OpenClosed ? v <= w.hi : v < w.hi;
  return lo_ok && hi_ok;
}

std::string rule_text(const Within& w, bool integer) {
  if (integer && w.ends == Ends::Closed && w.hi == w.lo + 1)
    return str_cat(number(w.lo, true), " or ", number(w.hi, true));
  const bool lo_closed = w.ends == Ends::Closed || w.ends == Ends::ClosedOpen;
  const bool hi_closed = w.ends == Ends::Closed || w.ends == Ends::OpenClosed;
  return str_cat("in ", lo_closed ? "[" : "(", number(w.lo, integer), ", ", number(w.hi, integer),
                 hi_closed ? "]" : ")");
}

std::string numeric_problem(const FieldCheck& check, std::string_view key, double v, bool integer) {
  const std::string head = str_cat(key, "=", number(v, integer), " must be ");
  struct {
    std::string head;
    double v;
    bool integer;
    std::string_view key;
    std::string operator()(std::monostate) const { return ""; }
    std::string operator()(const AtLeast& r) const {
      return v >= r.min ? "" : str_cat(head, ">= ", number(r.min, integer), r.why);
    }
    std::string operator()(const Above& r) const {
      return v > r.min ? "" : str_cat(head, "> ", number(r.min, integer), r.why);
    }
    std::string operator()(const Within& r) const { return meets(r, v) ? "" : head + rule_text(r, integer); }
    std::string operator()(const NotEmpty&) const { return wrong(); }
    std::string operator()(const TextRule&) const { return wrong(); }
    std::string wrong() const { fail(ErrorKind::Internal, "config schema: ", key, " is a number; its rule is for text"); }
  } visit{head, v, integer, key};
  return std::visit(visit, check);
}

}  // namespace

std::string field_problem(const FieldCheck& check, std::string_view key, int64_t value) {
  return numeric_problem(check, key, double(value), true);
}

std::string field_problem(const FieldCheck& check, std::string_view key, double value) {
  return numeric_problem(check, key, value, false);
}

std::string field_problem(const FieldCheck& check, std::string_view key, const std::string& text) {
  if (std::holds_alternative<std::monostate>(check)) return "";
  if (const NotEmpty* r = std::get_if<NotEmpty>(&check)) return text.empty() ? str_cat(key, " is empty: ", r->why) : "";
  if (const TextRule* r = std::get_if<TextRule>(&check)) return r->problem(key, text);
  fail(ErrorKind::Internal, "config schema: ", key, " is text; its rule is for a number");
}

std::string host_port_problem(std::string_view key, const std::string& value) {
  if (value.empty()) return "";
  const size_t colon = value.rfind(':');
  const std::string port = colon == std::string::npos ? "" : value.substr(colon + 1);
  const bool digits = !port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos;
  if (colon == 0 || !digits || std::stol(port) < 1 || std::stol(port) > 65535)
    return str_cat(key, "='", value, "' is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9400)");
  return "";
}

}  // namespace xirang
