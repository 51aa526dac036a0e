// Fuzz target: a run's YAML config and its --set overrides, parsed and
// validated (runtime/config). The input is the YAML text, then each
// override after a NUL byte:
//   "model:\n  n_layer: 2\n" "\0" "train.lr=1e-3" "\0" "parallel.tp=2"
// Every input must parse or be refused with xirang::Error; validation runs
// for one rank and for eight.
#include <cstdint>
#include <vector>

#include "runtime/config/config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xirang;
  std::vector<std::string> p = fuzz::pieces(data, size);
  const std::string yaml = p.front();
  const std::vector<std::string> overrides(p.begin() + 1, p.end());
  fuzz::expect_errors([&] {
    const Config c = parse_config(yaml, overrides, "fuzz.yaml");
    for (int world : {1, 8}) {
      Config v = c;
      fuzz::expect_errors([&] { validate(v, world); });
    }
  });
  return 0;
}
