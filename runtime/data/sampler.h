// runtime/data/sampler.h: which token sequences make up each batch.
//
// A sample is seq_len + 1 consecutive tokens (inputs and, shifted by one,
// targets); sample i starts at token i * seq_len. Each epoch visits every
// sample once in an order that is a pure function of (seed, epoch). Step s
// of training uses the global samples [s * global_batch, (s + 1) *
// global_batch) of that sequence, split into contiguous parts per dp rank and
// microbatch, so every layout sees exactly the same global batch.
//
//   SequenceSampler sampler(dataset, seq_len, seed);
//   sampler.fill(sampler.global_index(step, global_batch, k), tokens, targets);
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/data/dataset.h"

namespace xirang {

class SequenceSampler {
 public:
  SequenceSampler(const TokenDataset& data, int seq_len, uint64_t seed, bool shuffle = true);
  int64_t samples_per_epoch() const { return n_samples_; }
  // Global sample number of the k-th sequence of `step`'s global batch.
  static int64_t global_index(int64_t step, int64_t global_batch, int64_t k) { return step * global_batch + k; }
  // Token offset where global sample g starts (epoch g / n, shuffled position g % n).
  int64_t sample_start(int64_t g);
  // Writes seq_len inputs and seq_len targets of global sample g.
  void fill(int64_t g, int32_t* tokens, int32_t* targets);

 private:
  const TokenDataset& data_;
  int seq_len_;
  uint64_t seed_;
  bool shuffle_;
  int64_t n_samples_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;  // permutation of the current epoch
  std::vector<int32_t> buf_;    // seq_len + 1 tokens
};

}  // namespace xirang
