// tests/runtime/trainer_fixture.h: what the single-rank trainer tests share:
// a byte dataset of the repository's English text, gpt2_debug on it, quiet
// options, and the parameters as doubles.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/config.h"
#include "runtime/data/dataset.h"
#include "runtime/trainer.h"
#include "tests/support/temp_dir.h"

namespace xirang::trainer_testing {

namespace fs = std::filesystem;

// English text that ships with the repository (tests/assets/text/english.txt,
// 260 KB: far more than the 10 steps x 8 sequences x 65 bytes a run reads),
// one document, byte tokens.
inline std::string english_dataset() {
  static const std::string dir = [] {
    // Per process: ctest runs the tests of this file concurrently, each in its own process.
    const fs::path root = fs::path(::testing::TempDir()) / ("xirang_trainer_test_" + std::to_string(::getpid()));
    testing_util::temp_dirs->paths.push_back(root.string());
    const fs::path out = root / "train";
    fs::remove_all(out);
    DatasetWriter w(out.string(), "bytes", 256, -1);
    const std::string path = std::string(XIRANG_SOURCE_DIR) + "/tests/assets/text/english.txt";
    std::ifstream f(path, std::ios::binary);
    EXPECT_TRUE(f.good()) << "missing " << path;
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::vector<int32_t> ids(text.begin(), text.end());
    for (auto& id : ids) id &= 0xff;
    w.add_document(ids.data(), ids.size());
    w.finish();
    return out.string();
  }();
  return dir;
}

inline Config debug_config(std::vector<std::string> overrides = {}) {
  overrides.insert(overrides.begin(), "data.train=" + english_dataset());
  Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/gpt2_debug.yaml", overrides);
  validate(c, 1);
  return c;
}

inline TrainerOptions quiet() {
  TrainerOptions o;
  o.print = false;
  o.peak = PeakFlops{1e11, "test"};
  return o;
}

// Every parameter element, widened from the model's dtype.
inline std::vector<double> flat_params(Trainer& t) {
  std::vector<double> out;
  for (auto& p : t.parameters()) {
    const size_t at = out.size();
    out.resize(at + size_t(p.value.numel()));
    convert_elements(p.value.raw(), p.value.dtype(), out.data() + at, DType::F64, p.value.numel());
  }
  return out;
}

inline double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

}  // namespace xirang::trainer_testing
