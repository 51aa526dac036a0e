// runtime/config/config_text.h: what config.cc (the schema), config_read.cc
// (files, presets) and validate.cc (rules) share; internal to runtime/config.
//
//   config_fail(str_cat(where, ": key '", key, "' has value '", text, "'"));  // one line, ErrorKind::Config
//   out << format_double(6e-4);                                                // "6.0e-04", reads back exactly
#pragma once

#include <string>

#include "runtime/config/config.h"

namespace YAML {
class Node;
}

namespace xirang {

// Throws ErrorKind::Config with `msg` on one line (newlines escaped).
[[noreturn]] void config_fail(const std::string& msg);
// The shortest text that reads back to the same double, as a YAML float.
std::string format_double(double v);

// config.cc's schema, for config_read.cc: the keys of a YAML tree (every
// section but `skip`), one "section.key=value" override, the config as YAML.
void apply_yaml(Config& c, const YAML::Node& root, const std::string& source, const std::string& skip = "");
void apply_override(Config& c, const std::string& item);
std::string emit_yaml(const Config& config);
// The rules of the schema's rows (field_check.h), in schema order: the first
// broken one's message ("train.lr=0 must be > 0"), or "" (validate.cc).
std::string first_field_problem(const Config& config);
// "file:line" of a node, or `source` when it has no mark.
std::string where_of(const std::string& source, const YAML::Node& n);

}  // namespace xirang
