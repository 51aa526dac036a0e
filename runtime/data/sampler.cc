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

}  // namespace xirang
