// Fuzz target: a checkpoint step's meta.json (runtime/checkpoint/
// checkpoint_io.h), read as resuming and `ckpt inspect` read it, and the
// run configuration it carries, parsed as `ckpt convert` parses it. The
// input is the file; it must load or be refused with xirang::Error.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/config.h"
#include "tests/fuzz/fuzz_util.h"

namespace {
std::string step_dir;  // this process's scratch step directory
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("xirang_fuzz_meta." + std::to_string(::getpid())) / "step_00000001";
  fs::create_directories(dir);
  step_dir = dir.string();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xirang;
  {
    std::ofstream out(step_dir + "/meta.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  fuzz::expect_errors([&] {
    const CheckpointMeta meta = read_checkpoint_meta(step_dir);
    fuzz::expect_errors([&] { (void)parse_config(meta.config_yaml, {}, step_dir + "/meta.json"); });
  });
  return 0;
}
