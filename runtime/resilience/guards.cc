#include "runtime/resilience/guards.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/device_memory.h"

namespace xirang {

bool all_finite(const Tensor& t, void* stream) {
  if (t.numel() == 0) return true;
  XR_CHECK(is_float(t.dtype()), "all_finite needs a float tensor, got ", t.str());
  std::vector<unsigned char> copy;
  const unsigned char* p = static_cast<const unsigned char*>(t.raw());
  if (t.device() != Device::CPU) {
    copy.resize(t.bytes());
    copy_bytes(copy.data(), Device::CPU, t.raw(), t.device(), t.bytes(), stream, true);
    p = copy.data();
  }
  const int64_t n = t.numel();
  bool ok = true;
  switch (t.dtype()) {
    case DType::F32: {
      const float* f = reinterpret_cast<const float*>(p);
      for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(f[i]);
      break;
    }
    case DType::F64: {
      const double* d = reinterpret_cast<const double*>(p);
      for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(d[i]);
      break;
    }
    default: {
      // bf16 and f16: the exponent bits all set is inf or NaN.
      const uint16_t mask = t.dtype() == DType::BF16 ? 0x7f80 : 0x7c00;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        ok &= (b & mask) != mask;
      }
    }
  }
  return ok;
}

std::pair<int, std::string> lowest_rank_text(Communicator& world, bool have, const std::string& text) {
  const int me = world.rank(), n = world.size();
  double lowest = have ? -me : -n;  // a max over the negated ranks
  world.all_reduce(Tensor(&lowest, {1}, DType::F64), ReduceOp::Max);
  const int from = int(-lowest);
  if (from >= n) return {-1, ""};
  std::vector<double> chars(1001, 0.0);  // the text travels as characters in a sum
  for (size_t i = 0; me == from && i < std::min(text.size(), chars.size() - 1); ++i)
    chars[i] = double(static_cast<unsigned char>(text[i]));
  world.all_reduce(Tensor(chars.data(), {int64_t(chars.size())}, DType::F64), ReduceOp::Sum);
  std::string out;
  for (double c : chars) {
    if (c == 0) break;
    out.push_back(char(int(c)));
  }
  return {from, out};
}

bool LossSpikeGuard::spike(double loss) {
  bool out = false;
  if (losses_.size() >= warmup_) {
    double sum = 0, sq = 0;
    for (double l : losses_) sum += l;
    mean_ = sum / double(losses_.size());
    for (double l : losses_) sq += (l - mean_) * (l - mean_);
    sd_ = std::sqrt(sq / double(losses_.size()));
    n_ = losses_.size();
    out = sd_ > 0 && (loss - mean_) > z_ * sd_;
  }
  losses_.push_back(loss);
  if (losses_.size() > window_) losses_.pop_front();
  return out;
}

StepGuard::StepGuard(const TrainConfig& train, Communicator& world, LossScale& scale, bool logger, Hooks hooks)
    : train_(train), world_(world), scale_(scale), logger_(logger), hooks_(std::move(hooks)) {}

StepGuard::Verdict StepGuard::vote(int step, double grad_norm, double local_loss, double extra) {
  const bool loss_bad = !std::isfinite(local_loss), norm_bad = !std::isfinite(grad_norm);
  double votes[3] = {loss_bad ? 1.0 : 0.0, norm_bad ? 1.0 : 0.0, extra};
  world_.all_reduce(Tensor(votes, {3}, DType::F64), ReduceOp::Max);
  Verdict v{false, votes[2]};
  const bool any_loss = votes[0] > 0, skip = votes[0] > 0 || votes[1] > 0;
  const bool counted = any_loss || (skip && !scale_.can_back_off());
  if (scale_.enabled()) scale_.update(skip);
  if (!skip) {
    nonfinite_run_ = 0;
    v.skip = loss_spike(step, local_loss);
    return v;
  }
  v.skip = true;
  if (!counted) return v;
  const std::string cause = nonfinite_cause(loss_bad, norm_bad, any_loss);
  if (++nonfinite_run_ == 1) nonfinite_first_ = str_cat("step ", step, ": ", cause);
  const int limit = train_.max_nonfinite_steps;
  if (nonfinite_run_ >= limit) {
    if (hooks_.before_failing) hooks_.before_failing();  // a save in flight is from finite state
    fail(ErrorKind::Data, "training stopped at step ", step, ": ", limit, " step", limit > 1 ? "s" : "",
         " in a row skipped for non-finite values (train.max_nonfinite_steps=", limit, "); the first, ",
         nonfinite_first_);
  }
  if (logger_)
    std::fprintf(stderr, "step %d: update skipped (%d of train.max_nonfinite_steps=%d in a row): %s\n", step,
                 nonfinite_run_, limit, cause.c_str());
  return v;
}

bool StepGuard::loss_spike(int step, double local_loss) {
  const double z = train_.skip_loss_spikes_zscore;
  if (!(z > 0)) return false;
  if (!spike_guard_) spike_guard_.emplace(z);
  const double loss = hooks_.global_loss(local_loss);
  // Every rank keeps the same window, but the vote makes the answer the same regardless.
  const bool spike = world_.all_reduce_sum(spike_guard_->spike(loss) ? 1.0 : 0.0) > 0;
  if (spike && logger_)
    std::fprintf(stderr,
                 "step %d: update skipped: loss %.4f is more than %g standard deviations above the mean %.4f "
                 "(standard deviation %.4f) of the last %zu steps (train.skip_loss_spikes_zscore)\n",
                 step, loss, z, spike_guard_->mean(), spike_guard_->stddev(), spike_guard_->compared());
  return spike;
}

std::string StepGuard::nonfinite_cause(bool local_loss_bad, bool local_norm_bad, bool any_loss_bad) {
  if (any_loss_bad) {
    const int from = lowest_rank_text(world_, local_loss_bad, "").first;
    return str_cat("non-finite loss (first seen on rank ", from, ")");
  }
  // This rank's first parameter (of those its norm covered) with a non-finite gradient.
  const std::string name = local_norm_bad ? hooks_.bad_gradient() : std::string();
  const auto [from, agreed] = lowest_rank_text(world_, !name.empty(), name);
  if (from < 0) return "non-finite gradient norm (every gradient element is finite: the sum of squares overflowed)";
  return str_cat("non-finite gradient of parameter '", agreed, "' (on rank ", from, ")");
}

}  // namespace xirang
