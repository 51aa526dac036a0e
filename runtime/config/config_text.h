// runtime/config/config_text.h: the text helpers that config.cc (parsing) and
// validate.cc (rules) share; internal to runtime/config.
//
//   config_fail(str_cat(where, ": key '", key, "' has value '", text, "'"));  // one line, ErrorKind::Config
//   out << format_double(6e-4);                                                // "6.0e-04", reads back exactly
#pragma once

#include <string>

namespace xirang {

// Throws ErrorKind::Config with `msg` on one line (newlines escaped).
[[noreturn]] void config_fail(const std::string& msg);
// The shortest text that reads back to the same double, as a YAML float.
std::string format_double(double v);

}  // namespace xirang
