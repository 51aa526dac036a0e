// tests/kernels/cp_rows.h: a context-parallel test's shape and the moves
// between a sequence's rows and one cp rank's (kernels/context_split.h), for
// the all-gather and ring attention tests that play a whole cp group in one
// process.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/context_split.h"

namespace xirang::test {

struct CpShape {
  int64_t B, T, H, KV, D;
  int c;
  bool head_tail;
  int64_t C() const { return H * D; }
  int64_t W() const { return (H + 2 * KV) * D; }
  int64_t KVW() const { return 2 * KV * D; }
  ContextSplit split() const { return ContextSplit::of(T, c, head_tail); }
  std::string str() const {
    return "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) + " KV " +
           std::to_string(KV) + " D " + std::to_string(D) + " c " + std::to_string(c) +
           (head_tail ? " head-tail" : " contiguous");
  }
};

// Rank r's rows of a (B, T, w) tensor: (B, T / c, w), local row t = position(r, t).
template <class S>
std::vector<S> local_rows(const std::vector<S>& full, const CpShape& a, int64_t w, int r) {
  const ContextSplit s = a.split();
  const int64_t Tl = s.local_rows();
  std::vector<S> v(size_t(a.B * Tl * w));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t t = 0; t < Tl; ++t)
      std::copy_n(full.begin() + (b * a.T + s.position(r, t)) * w, w, v.begin() + (b * Tl + t) * w);
  return v;
}

// The inverse: rank r's rows put back into the full (B, T, w) tensor.
template <class S>
void put_rows(std::vector<S>& full, const std::vector<S>& local, const CpShape& a, int64_t w, int r) {
  const ContextSplit s = a.split();
  const int64_t Tl = s.local_rows();
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t t = 0; t < Tl; ++t)
      std::copy_n(local.begin() + (b * Tl + t) * w, w, full.begin() + (b * a.T + s.position(r, t)) * w);
}

}  // namespace xirang::test
