// tests/support/expect_error.h: asserting on xirang::Error.
//
//   expect_error([&] { t.slice(3, 9); }, ErrorKind::Internal, {"slice", "[3, 9)"});
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "core/error.h"

namespace xirang {

// Runs f and checks it throws xirang::Error of `kind` with every part in its message.
inline void expect_error(const std::function<void()>& f, ErrorKind kind, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

}  // namespace xirang
