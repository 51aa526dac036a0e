// tests/fuzz/fuzz_util.h: what every fuzz target shares.
//
//   extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
//     xirang::fuzz::expect_errors([&] { parse_index(xirang::fuzz::text(data, size), "index.json"); });
//     return 0;
//   }
//
// A parser may refuse its input only with xirang::Error, the exception the
// command line turns into one clear line; anything else that escapes (a
// std::out_of_range from a container, a library's own exception type)
// aborts the run, and libFuzzer keeps the input as a crash.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "core/error.h"

namespace xirang::fuzz {

inline std::string text(const uint8_t* data, size_t size) { return std::string(reinterpret_cast<const char*>(data), size); }

// The input split at NUL bytes: the first piece and the rest.
inline std::vector<std::string> pieces(const uint8_t* data, size_t size) {
  std::vector<std::string> out(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) out.emplace_back();
    else out.back().push_back(char(data[i]));
  }
  return out;
}

template <typename F>
void expect_errors(F&& f) {
  try {
    f();
  } catch (const Error&) {
    // refused with one clear line: what a hostile file should get
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: an exception other than xirang::Error escaped: %s\n", e.what());
    std::abort();
  }
}

}  // namespace xirang::fuzz
