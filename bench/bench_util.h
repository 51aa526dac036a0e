// bench/bench_util.h: helpers shared by the benchmarks.
//
//   write_random_tokens(dir + "/train", "bytes", 256, 1 << 18, seed);
//   double ms = median(step_times);
//   double ns = ns_per_call(1000000, [&](long i) { site(i); });
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/rng.h"
#include "runtime/data/dataset.h"

namespace xirang::bench {

// A one-document split of n random tokens: throughput does not depend on
// the text, and the benchmarks need no prepared data.
inline void write_random_tokens(const std::string& split_dir, const std::string& tokenizer, int64_t vocab,
                                size_t n, uint64_t seed) {
  DatasetWriter w(split_dir, tokenizer, vocab, -1, int64_t(1) << 28, /*overwrite=*/true);
  std::vector<int32_t> doc(n);
  for (size_t i = 0; i < n; ++i) doc[i] = int32_t(rng_below(seed, 2, i, uint64_t(vocab)));
  w.add_document(doc.data(), doc.size());
  w.finish();
}

// The median (the upper one for an even count) of a non-empty list.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Nanoseconds per call of body(i), the best of five loops of n calls (the
// fastest loop is the one least disturbed by the rest of the machine).
template <class F>
double ns_per_call(long n, F&& body) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now_seconds();
    for (long i = 0; i < n; ++i) body(i);
    best = std::min(best, (now_seconds() - t0) * 1e9 / double(n));
  }
  return best;
}

}  // namespace xirang::bench
