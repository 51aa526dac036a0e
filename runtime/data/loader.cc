#include "runtime/data/loader.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "core/clock.h"
#include "core/error.h"

namespace xirang {

namespace {

// Weight of the newest sample in the moving averages: about the last 5-10
// microbatches count, enough to follow a change of phase within a few steps
// without chasing a single slow read.
constexpr double kAlpha = 0.2;
// Wait-free calls wanting a smaller depth before the depth drops by one.
constexpr int kCalmCalls = 16;

void average_in(double& avg, double sample, bool first) { avg = first ? sample : avg + kAlpha * (sample - avg); }

}  // namespace

PrefetchLoader::PrefetchLoader(const TokenDataset& data, const LoaderSpec& spec, const LoaderOptions& opts)
    : data_(data), spec_(spec), opts_(opts) {
  const LoaderSpec& s = spec_;
  if (s.seq_len < 1) fail(ErrorKind::Config, "loader: seq_len ", s.seq_len, " must be >= 1");
  if (s.micro_batch < 1) fail(ErrorKind::Config, "loader: micro_batch ", s.micro_batch, " must be >= 1");
  if (s.dp < 1 || s.dp_rank < 0 || s.dp_rank >= s.dp)
    fail(ErrorKind::Config, "loader: dp_rank ", s.dp_rank, " is not in [0, dp = ", s.dp, ")");
  if (s.microbatches < 1 || s.global_batch != int64_t(s.dp) * s.micro_batch * s.microbatches)
    fail(ErrorKind::Config, "loader: global_batch ", s.global_batch, " must equal dp (", s.dp, ") x micro_batch (",
         s.micro_batch, ") x microbatches (", s.microbatches, ")");
  if (s.first_step < 0) fail(ErrorKind::Config, "loader: first_step ", s.first_step, " must be >= 0");
  // A middle pipeline stage reads nothing; it should not have a loader at all.
  if (!s.need_tokens && !s.need_targets) fail(ErrorKind::Config, "loader: the rank needs neither tokens nor targets");
  if (opts_.enabled) {
    if (opts_.threads < 1) fail(ErrorKind::Config, "loader: threads ", opts_.threads, " must be >= 1");
    if (opts_.prefetch_min < 1 || opts_.prefetch_max < opts_.prefetch_min)
      fail(ErrorKind::Config, "loader: prefetch_min ", opts_.prefetch_min, " and prefetch_max ", opts_.prefetch_max,
           " must satisfy 1 <= prefetch_min <= prefetch_max");
  }
  if (opts_.read_delay_ms < 0) fail(ErrorKind::Config, "loader: read_delay_ms ", opts_.read_delay_ms, " must be >= 0");
  per_rank_ = s.global_batch / s.dp;
  for (const int64_t at : s.rows.starts)
    if (s.rows.length < 1 || at < 0 || at + s.rows.length > s.seq_len)
      fail(ErrorKind::Config, "loader: rows [", at, ", ", at + s.rows.length, ") are not within a sample of seq_len ",
           s.seq_len);

  // One sampler per reading thread: SequenceSampler caches the current
  // epoch's permutation and is not thread-safe. Made here, so a dataset too
  // small for one sample fails on the constructing thread.
  const size_t n_readers = opts_.enabled ? size_t(opts_.threads) : 1;
  readers_.resize(n_readers);
  for (Reader& r : readers_) {
    r.sampler = std::make_unique<SequenceSampler>(data_, s.seq_len, s.seed, true);
    r.scratch_tokens.resize(size_t(rows()));
    r.scratch_targets.resize(size_t(rows()));
  }
  const size_t n = size_t(s.micro_batch) * size_t(rows());
  if (s.device != Device::CPU) {
    if (s.staging_buffers < 1) fail(ErrorKind::Config, "loader: staging_buffers ", s.staging_buffers, " must be >= 1");
    for (int i = 0; i < s.staging_buffers; ++i) staging_.emplace_back(2 * n * sizeof(int32_t), s.device);
  }
  depth_ = opts_.enabled ? opts_.prefetch_min : 0;
  stats_.depth = depth_;
  if (!opts_.enabled) return;

  slots_.resize(size_t(opts_.prefetch_max));
  for (Slot& slot : slots_) {
    if (s.need_tokens) slot.tokens.resize(n);
    if (s.need_targets) slot.targets.resize(n);
  }
  try {
    for (int w = 0; w < opts_.threads; ++w) threads_.emplace_back([this, w] { worker(w); });
  } catch (...) {
    stop_workers();  // threads already started must not outlive a failed constructor
    throw;
  }
}

PrefetchLoader::~PrefetchLoader() { stop_workers(); }

void PrefetchLoader::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  stop_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

bool PrefetchLoader::load(Reader& r, int64_t seq, int32_t* tokens, int32_t* targets, bool interruptible) {
  const int64_t T = rows();
  const int64_t step = spec_.first_step + seq / spec_.microbatches;
  const int64_t mb = seq % spec_.microbatches;
  if (opts_.fail_after >= 0 && seq >= opts_.fail_after)
    fail(ErrorKind::Data, "injected read failure (loader fail_after = ", opts_.fail_after, ") at step ", step,
         " microbatch ", mb, " of dataset ", data_.dir());
  for (int b = 0; b < spec_.micro_batch; ++b) {
    if (opts_.read_delay_ms > 0) {
      const auto delay = std::chrono::duration<double, std::milli>(opts_.read_delay_ms);
      if (!interruptible) {
        std::this_thread::sleep_for(delay);
      } else {
        // A plain sleep would make the destructor wait out every delay in
        // progress; waiting on stop_cv_ ends it as soon as the loader stops.
        std::unique_lock<std::mutex> lk(mu_);
        if (stop_cv_.wait_for(lk, delay, [this] { return stop_; })) return false;
      }
    }
    const int64_t k = int64_t(spec_.dp_rank) * per_rank_ + mb * spec_.micro_batch + b;
    r.sampler->fill(SequenceSampler::global_index(step, spec_.global_batch, k), spec_.rows,
                    tokens ? tokens + int64_t(b) * T : r.scratch_tokens.data(),
                    targets ? targets + int64_t(b) * T : r.scratch_targets.data());
  }
  return true;
}

void PrefetchLoader::worker(int w) {
  Reader& reader = readers_[size_t(w)];
  const int64_t cap = int64_t(slots_.size());
  for (;;) {
    int64_t seq;
    Slot* slot;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // depth_ <= cap, so the slot of next_claim_ was freed by the consumer.
      work_cv_.wait(lk, [this] { return stop_ || (!broken_ && next_claim_ < next_take_ + depth_); });
      if (stop_) return;
      seq = next_claim_++;
      slot = &slots_[size_t(seq % cap)];
      slot->state = SlotState::Loading;
      slot->seq = seq;
    }
    // The slot is this worker's until it is marked Ready: the consumer reads
    // only Ready slots and no other worker can claim the same one.
    Stopwatch sw;
    std::exception_ptr error;
    bool done = false;
    try {
      done = load(reader, seq, slot->tokens.empty() ? nullptr : slot->tokens.data(),
                  slot->targets.empty() ? nullptr : slot->targets.data(), true);
    } catch (...) {
      error = std::current_exception();
    }
    if (!done && !error) return;  // stopped mid-read
    const double ms = sw.ms();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (error) {
        slot->state = SlotState::Failed;
        slot->error = error;
        broken_ = true;  // later reads are pointless: next() stops at this one
      } else {
        slot->state = SlotState::Ready;
        average_in(stats_.mean_load_ms, ms, stats_.loaded == 0);
        ++stats_.loaded;
      }
    }
    ready_cv_.notify_one();
  }
}

void PrefetchLoader::retune(bool waited) {
  if (stats_.loaded == 0 || intervals_ == 0) return;  // nothing measured yet
  // Guard the ratio: a caller that comes straight back (interval ~ 0) wants the maximum.
  const double ratio = stats_.mean_load_ms / std::max(stats_.mean_consume_interval_ms, 1e-3);
  const int lo = opts_.prefetch_min, hi = opts_.prefetch_max;
  const int want = ratio >= hi ? hi : std::clamp(int(std::ceil(ratio)) + 1, lo, hi);
  if (waited) {
    depth_ = std::min(hi, std::max(want, depth_ + 1));
    calm_ = 0;
  } else if (want >= depth_) {
    depth_ = want;
    calm_ = 0;
  } else if (++calm_ >= kCalmCalls) {
    --depth_;
    calm_ = 0;
  }
  stats_.depth = depth_;
}

void PrefetchLoader::next(int64_t step, int mb, int32_t* tokens, int32_t* targets) {
  if (step != next_step() || mb != next_microbatch())
    fail(ErrorKind::Internal, "loader: asked for step ", step, " microbatch ", mb, " but the next in order is step ",
         next_step(), " microbatch ", next_microbatch());
  XR_CHECK(!tokens || spec_.need_tokens, "loader: tokens requested from a loader built without need_tokens");
  XR_CHECK(!targets || spec_.need_targets, "loader: targets requested from a loader built without need_targets");
  const double entry = now_seconds();
  const size_t n = size_t(spec_.micro_batch) * size_t(rows());
  if (!opts_.enabled) return next_unbuffered(tokens, targets, entry);

  Slot& slot = slots_[size_t(next_take_ % int64_t(slots_.size()))];
  bool waited = false;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (last_return_ >= 0) average_in(stats_.mean_consume_interval_ms, 1e3 * (entry - last_return_), intervals_++ == 0);
    auto ready = [&] {
      return slot.seq == next_take_ && (slot.state == SlotState::Ready || slot.state == SlotState::Failed);
    };
    if (!ready()) {
      Stopwatch sw;
      ready_cv_.wait(lk, ready);
      const double ms = sw.ms();
      waited = true;
      ++stats_.waits;
      stats_.wait_ms += ms;
      wait_pending_ms_ += ms;
    }
    // Leaves the slot Failed and next_take_ unchanged: every later call
    // rethrows the same error rather than handing out data past a hole.
    if (slot.state == SlotState::Failed) std::rethrow_exception(slot.error);
  }
  // Outside the lock: this slot is reused only for seq next_take_ + cap,
  // which no worker may claim before next_take_ advances below.
  if (tokens) std::memcpy(tokens, slot.tokens.data(), n * sizeof(int32_t));
  if (targets) std::memcpy(targets, slot.targets.data(), n * sizeof(int32_t));
  {
    std::lock_guard<std::mutex> lk(mu_);
    slot.state = SlotState::Free;
    ++next_take_;
    last_return_ = now_seconds();
    retune(waited);
  }
  // notify_all: the depth may have grown by more than one slot.
  work_cv_.notify_all();
}

void PrefetchLoader::next_unbuffered(int32_t* tokens, int32_t* targets, double entry) {
  // The read is the wait: nothing was read ahead.
  Stopwatch sw;
  load(readers_[0], next_take_, tokens, targets, false);
  const double ms = sw.ms();
  std::lock_guard<std::mutex> lk(mu_);
  if (last_return_ >= 0) average_in(stats_.mean_consume_interval_ms, 1e3 * (entry - last_return_), intervals_++ == 0);
  average_in(stats_.mean_load_ms, ms, stats_.loaded == 0);
  ++stats_.loaded;
  ++stats_.waits;
  stats_.wait_ms += ms;
  wait_pending_ms_ += ms;
  ++next_take_;
  last_return_ = now_seconds();
}

void PrefetchLoader::next(int64_t step, int mb, const Tensor& tokens, const Tensor& targets, void* stream) {
  const int64_t n = int64_t(spec_.micro_batch) * rows();
  for (const Tensor* t : {&tokens, &targets})
    XR_CHECK(!t->defined() || (t->dtype() == DType::I32 && t->numel() == n && t->device() == spec_.device),
             "loader: a microbatch goes into (B, rows) = (", spec_.micro_batch, ", ", rows(), ") int32 on ",
             device_name(spec_.device), ", got ", t->str());
  if (spec_.device == Device::CPU)
    return next(step, mb, tokens.defined() ? tokens.data<int32_t>() : nullptr,
                targets.defined() ? targets.data<int32_t>() : nullptr);
  HostStaging& st = staging_[next_staging_];
  next_staging_ = (next_staging_ + 1) % staging_.size();
  st.wait_reusable();  // its previous microbatch's upload has read it
  int32_t* host = static_cast<int32_t*>(st.data());
  next(step, mb, tokens.defined() ? host : nullptr, targets.defined() ? host + n : nullptr);
  const size_t bytes = size_t(n) * sizeof(int32_t);
  if (tokens.defined()) st.upload(tokens.raw(), 0, bytes, stream);
  if (targets.defined()) st.upload(targets.raw(), bytes, bytes, stream);
}

double PrefetchLoader::take_wait_ms() {
  std::lock_guard<std::mutex> lk(mu_);
  const double ms = wait_pending_ms_;
  wait_pending_ms_ = 0;
  return ms;
}

int PrefetchLoader::depth() const {
  std::lock_guard<std::mutex> lk(mu_);
  return depth_;
}

LoaderStats PrefetchLoader::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

}  // namespace xirang
