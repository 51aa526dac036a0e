// tests/runtime/config_errors.h: asserting on config errors (one line,
// ErrorKind::Config, naming what it must), for config_test.cc and
// config_validate_test.cc.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/config/config.h"

namespace xirang {

// Runs fn, expects an Error of kind Config on one line that contains every
// needle; returns the message for further checks.
inline std::string expect_config_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::Config) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    return msg;
  }
  ADD_FAILURE() << "no error thrown; expected one containing '" << (needles.empty() ? "" : needles[0]) << "'";
  return "";
}

inline void expect_parse_error(const std::string& yaml, const std::vector<std::string>& needles,
                        const std::vector<std::string>& overrides = {}) {
  SCOPED_TRACE(yaml);
  expect_config_error([&] { parse_config(yaml, overrides, "test.yaml"); }, needles);
}

}  // namespace xirang
