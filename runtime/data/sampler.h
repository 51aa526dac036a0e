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
//
// Context parallelism: a cp rank holds only some rows of each sample (its
// two chunks, kernels/context_split.h) and reads only those, SampleRows
// naming them; the trainer makes one from the chunk's ContextSplit.
//
//   SampleRows rows{.length = L, .starts = {i * L, (2 * c - 1 - i) * L}};
//   sampler.fill(g, rows, tokens, targets);   // 2L rows: rows(), in local order
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/data/dataset.h"

namespace xirang {

// The rows of each sample a rank reads, in its local order: runs of `length`
// positions starting at `starts` (no starts: the whole sequence). The target
// of position p is the sample's token p + 1, as for the whole sequence.
struct SampleRows {
  int64_t length = 0;
  std::vector<int64_t> starts;
  bool whole() const { return starts.empty(); }
  // Rows per sample: T for the whole sequence.
  int64_t rows(int seq_len) const { return whole() ? seq_len : length * int64_t(starts.size()); }
};

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
  // Writes rows.rows(seq_len) inputs and as many targets of global sample g:
  // each run, reading its length + 1 tokens and no others. Throws a Config
  // error for a run outside the sample.
  void fill(int64_t g, const SampleRows& rows, int32_t* tokens, int32_t* targets);

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
