// Fuzz target: a dataset split's index.json (runtime/data/dataset_index.h),
// parsed and validated as TokenDataset::open() does before it maps any
// shard. What parses must also survive being written back and parsed again.
#include <cstdint>

#include "runtime/data/dataset_index.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xirang;
  fuzz::expect_errors([&] {
    const DatasetIndex ix = parse_index(fuzz::text(data, size), "fuzz/index.json");
    const DatasetIndex again = parse_index(index_json_text(ix), "fuzz/index.json (written back)");
    if (index_json_text(again) != index_json_text(ix)) {
      std::fprintf(stderr, "fuzz: index.json does not survive a write and a read\n");
      std::abort();
    }
  });
  return 0;
}
