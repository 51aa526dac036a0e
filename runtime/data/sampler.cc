#include "runtime/data/sampler.h"

#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace xirang {

SequenceSampler::SequenceSampler(const TokenDataset& data, int seq_len, uint64_t seed, bool shuffle)
    : data_(data), seq_len_(seq_len), seed_(seed), shuffle_(shuffle), buf_(size_t(seq_len) + 1) {
  n_samples_ = (data.num_tokens() - 1) / seq_len;
  if (n_samples_ < 1)
    fail(ErrorKind::Data, "dataset has ", data.num_tokens(), " tokens, fewer than one sample of seq_len + 1 = ",
         seq_len + 1);
}

int64_t SequenceSampler::sample_start(int64_t g) {
  const int64_t epoch = g / n_samples_, pos = g % n_samples_;
  if (!shuffle_) return pos * seq_len_;
  if (epoch != epoch_) {
    // Fisher-Yates driven by the counter-based generator: the order depends
    // on (seed, epoch) only, never on how many samples were drawn before.
    order_.resize(size_t(n_samples_));
    std::iota(order_.begin(), order_.end(), int64_t(0));
    const uint64_t stream = name_stream("data.order") ^ uint64_t(epoch);
    for (int64_t i = n_samples_ - 1; i > 0; --i) {
      int64_t j = int64_t(rng_below(seed_, stream, uint64_t(i), uint64_t(i + 1)));
      std::swap(order_[size_t(i)], order_[size_t(j)]);
    }
    epoch_ = epoch;
  }
  return order_[size_t(pos)] * seq_len_;
}

void SequenceSampler::fill(int64_t g, int32_t* tokens, int32_t* targets) {
  data_.read(sample_start(g), seq_len_ + 1, buf_.data());
  for (int t = 0; t < seq_len_; ++t) {
    tokens[t] = buf_[size_t(t)];
    targets[t] = buf_[size_t(t) + 1];
  }
}

void SequenceSampler::fill(int64_t g, const SampleRows& rows, int32_t* tokens, int32_t* targets) {
  if (rows.whole()) return fill(g, tokens, targets);
  const int64_t start = sample_start(g), n = rows.length;
  int64_t out = 0;
  for (const int64_t at : rows.starts) {
    if (n < 1 || at < 0 || at + n > seq_len_)
      fail(ErrorKind::Config, "sampler: rows [", at, ", ", at + n, ") are not within a sample of seq_len ", seq_len_);
    data_.read(start + at, n + 1, buf_.data());  // n + 1 <= seq_len + 1 tokens: buf_'s size
    for (int64_t t = 0; t < n; ++t, ++out) {
      tokens[out] = buf_[size_t(t)];
      targets[out] = buf_[size_t(t) + 1];
    }
  }
}

}  // namespace xirang
