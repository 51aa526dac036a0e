// analysis/format.h: printf into a std::string, for the analyses' text
// (tables, advice, notes).
//
//   out += format("%-16s %10.4g s\n", name, seconds);
#pragma once

#include <cstdarg>
#include <cstdio>
#include <string>

namespace xirang::analysis {

// The formatted text, cut at 511 characters (one line of a table or a note).
inline std::string format(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string format(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

}  // namespace xirang::analysis
