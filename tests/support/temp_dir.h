// tests/support/temp_dir.h: a fresh directory per test, removed when the
// test binary ends (TempDir() itself is shared by every test binary).
//
//   std::string dir = fresh_test_dir("shards");
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace xirang::testing_util {

class TempDirs : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    for (const std::string& p : paths) std::filesystem::remove_all(p, ec);
  }
  std::vector<std::string> paths;
};

// One environment for the whole binary, however many test files include this.
inline TempDirs* const temp_dirs = static_cast<TempDirs*>(::testing::AddGlobalTestEnvironment(new TempDirs));

inline std::string fresh_test_dir(const std::string& tag = "data") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name();
  std::replace(name.begin(), name.end(), '/', '_');  // parameterized names contain '/'
  std::filesystem::path p =
      std::filesystem::path(::testing::TempDir()) / ("xirang_" + name + "_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  temp_dirs->paths.push_back(p.string());
  return p.string();
}

}  // namespace xirang::testing_util
