// PrefetchLoader: the same microbatches as SequenceSampler in consumption
// order, complete and disjoint over dp ranks, deterministic and resumable
// from any step; prefetching that hides slow reads; worker errors surfacing
// in next(); shutdown that never hangs.
#include "runtime/data/loader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "runtime/data/dataset.h"
#include "runtime/data/sampler.h"

#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& tag = "data") { return testing_util::fresh_test_dir(tag); }

constexpr int64_t kVocab = 50000;  // random windows of 17 such tokens never repeat in practice
constexpr int kT = 16;
// 64 samples of kT tokens (plus 5 spare tokens), in shards of 300 tokens so
// that many samples span a shard boundary.
constexpr int64_t kSamples = 64;
constexpr int64_t kTokens = kSamples * kT + 5;

// Writes kTokens random ids in [1, kVocab) as documents of random length.
TokenDataset make_dataset(const std::string& dir, uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> id(1, kVocab - 1);
  std::uniform_int_distribution<int> len(1, 90);
  DatasetWriter w(dir, "bytes", kVocab, -1, /*shard_tokens=*/300);
  std::vector<int32_t> doc;
  for (int64_t left = kTokens; left > 0;) {
    doc.resize(size_t(std::min<int64_t>(len(rng), left)));
    for (auto& t : doc) t = int32_t(id(rng));
    w.add_document(doc.data(), doc.size());
    left -= int64_t(doc.size());
  }
  w.finish();
  return TokenDataset::open(dir);
}

LoaderSpec spec_for(int B, int64_t GB, int dp, int rank, uint64_t seed = 1234, int64_t first_step = 0) {
  LoaderSpec s;
  s.seq_len = kT;
  s.seed = seed;
  s.micro_batch = B;
  s.global_batch = GB;
  s.dp = dp;
  s.dp_rank = rank;
  s.microbatches = int(GB / (int64_t(dp) * B));
  s.first_step = first_step;
  return s;
}

LoaderOptions options(bool enabled, int threads, int pmin = 2, int pmax = 8) {
  LoaderOptions o;
  o.enabled = enabled;
  o.threads = threads;
  o.prefetch_min = pmin;
  o.prefetch_max = pmax;
  return o;
}

struct Micro {
  std::vector<int32_t> tokens, targets;  // (B, T)
  bool operator==(const Micro&) const = default;
};

// The loader's next `steps` steps, microbatch by microbatch.
std::vector<Micro> drain(PrefetchLoader& loader, const LoaderSpec& s, int64_t steps) {
  std::vector<Micro> out;
  const size_t n = size_t(s.micro_batch) * kT;
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t step = loader.next_step();
    for (int mb = 0; mb < s.microbatches; ++mb) {
      Micro m{std::vector<int32_t>(n), std::vector<int32_t>(n)};
      loader.next(step, mb, m.tokens.data(), m.targets.data());
      out.push_back(std::move(m));
    }
  }
  return out;
}

// Microbatch (step, mb) as the trainer's fill_batch builds it from one sampler.
Micro reference(SequenceSampler& sampler, const LoaderSpec& s, int64_t step, int mb) {
  Micro m{std::vector<int32_t>(size_t(s.micro_batch) * kT), std::vector<int32_t>(size_t(s.micro_batch) * kT)};
  for (int b = 0; b < s.micro_batch; ++b) {
    const int64_t k = int64_t(s.dp_rank) * (s.global_batch / s.dp) + int64_t(mb) * s.micro_batch + b;
    sampler.fill(SequenceSampler::global_index(step, s.global_batch, k), m.tokens.data() + b * kT,
                 m.targets.data() + b * kT);
  }
  return m;
}

// Runs fn on its own thread and aborts the binary if it takes over 5 s: a
// hung destructor must fail the test run, not stall it.
void within_5s(const std::function<void()>& fn) {
  std::packaged_task<void()> task(fn);
  std::future<void> done = task.get_future();
  std::thread(std::move(task)).detach();
  if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    std::fprintf(stderr, "loader_test: %s hung for 5 s\n",
                 ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::abort();
  }
  done.get();
}

TEST(Loader, MatchesSamplerAcrossEpochBoundary) {
  TokenDataset ds = make_dataset(fresh_dir());
  // GB = 12 does not divide the 64 samples: epochs change mid-step, 2.8 epochs in all.
  LoaderSpec s = spec_for(/*B=*/2, /*GB=*/12, /*dp=*/2, /*rank=*/1);
  SequenceSampler sampler(ds, kT, s.seed);
  const int64_t steps = 15;
  struct Mode { bool enabled; int threads; };
  for (Mode mode : {Mode{false, 1}, Mode{true, 1}, Mode{true, 3}}) {
    for (auto [need_tokens, need_targets] : {std::pair{true, true}, {true, false}, {false, true}}) {
      SCOPED_TRACE(testing::Message() << "enabled=" << mode.enabled << " threads=" << mode.threads
                                      << " tokens=" << need_tokens << " targets=" << need_targets);
      LoaderSpec sp = s;
      sp.need_tokens = need_tokens;
      sp.need_targets = need_targets;
      PrefetchLoader loader(ds, sp, options(mode.enabled, mode.threads));
      std::vector<int32_t> tokens(size_t(s.micro_batch) * kT, -1), targets(tokens.size(), -1);
      for (int64_t step = 0; step < steps; ++step) {
        for (int mb = 0; mb < s.microbatches; ++mb) {
          loader.next(step, mb, need_tokens ? tokens.data() : nullptr, need_targets ? targets.data() : nullptr);
          const Micro want = reference(sampler, s, step, mb);
          if (need_tokens) {
            ASSERT_EQ(tokens, want.tokens) << "step " << step << " mb " << mb;
          }
          if (need_targets) {
            ASSERT_EQ(targets, want.targets) << "step " << step << " mb " << mb;
          }
        }
      }
      EXPECT_EQ(loader.next_step(), steps);
      EXPECT_EQ(loader.next_microbatch(), 0);
      EXPECT_GE(loader.stats().loaded, steps * s.microbatches);
    }
  }
}

// The tensor form of next() delivers the same microbatches; on the host it
// fills the tensors directly, and a tensor of the wrong shape or dtype is refused.
TEST(Loader, FillsTensors) {
  TokenDataset ds = make_dataset(fresh_dir());
  LoaderSpec s = spec_for(/*B=*/2, /*GB=*/8, /*dp=*/1, /*rank=*/0);
  SequenceSampler sampler(ds, kT, s.seed);
  PrefetchLoader loader(ds, s, options(true, 2));
  std::vector<int32_t> tokens(size_t(s.micro_batch) * kT), targets(tokens.size());
  const Tensor tk(tokens.data(), {s.micro_batch, kT}, DType::I32), tg(targets.data(), {s.micro_batch, kT}, DType::I32);
  for (int64_t step = 0; step < 3; ++step)
    for (int mb = 0; mb < s.microbatches; ++mb) {
      loader.next(step, mb, mb % 2 ? Tensor() : tk, tg, nullptr);
      const Micro want = reference(sampler, s, step, mb);
      if (mb % 2 == 0) {
        EXPECT_EQ(tokens, want.tokens) << "step " << step << " mb " << mb;
      }
      EXPECT_EQ(targets, want.targets) << "step " << step << " mb " << mb;
    }
  std::vector<float> wrong(tokens.size());
  try {
    loader.next(3, 0, Tensor(wrong.data(), {s.micro_batch, kT}, DType::F32), tg, nullptr);
    FAIL() << "a float tensor was filled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("int32"), std::string::npos) << e.what();
  }
  loader.next(3, 0, tk, tg, nullptr);  // the refused call consumed nothing
  EXPECT_EQ(tokens, reference(sampler, s, 3, 0).tokens);
}

TEST(Loader, DpRanksCoverAnEpochExactlyOnce) {
  TokenDataset ds = make_dataset(fresh_dir());
  // Every sample's T + 1 tokens identify its start (random ids from a large vocabulary).
  std::map<std::vector<int32_t>, int64_t> start_of;
  for (int64_t i = 0; i < kSamples; ++i) {
    std::vector<int32_t> w(kT + 1);
    ds.read(i * kT, kT + 1, w.data());
    ASSERT_TRUE(start_of.emplace(w, i * kT).second) << "sample windows repeat; pick another seed";
  }
  const int B = 2;
  const int64_t GB = 16;  // divides the 64 samples: one epoch is 4 steps
  for (int dp : {1, 2, 4}) {
    SCOPED_TRACE(testing::Message() << "dp=" << dp);
    std::map<int64_t, int> seen;
    for (int rank = 0; rank < dp; ++rank) {
      LoaderSpec s = spec_for(B, GB, dp, rank);
      PrefetchLoader loader(ds, s, options(true, 2));
      for (const Micro& m : drain(loader, s, kSamples / GB)) {
        for (int b = 0; b < B; ++b) {
          std::vector<int32_t> w(m.tokens.begin() + b * kT, m.tokens.begin() + (b + 1) * kT);
          w.push_back(m.targets[size_t(b * kT + kT - 1)]);
          auto it = start_of.find(w);
          ASSERT_NE(it, start_of.end()) << "rank " << rank << " produced a window that is no sample";
          ++seen[it->second];
        }
      }
    }
    ASSERT_EQ(int64_t(seen.size()), kSamples);
    for (auto [start, count] : seen) EXPECT_EQ(count, 1) << "sample at " << start;
  }
}

TEST(Loader, SameSeedSameStreamOtherSeedDiffers) {
  TokenDataset ds = make_dataset(fresh_dir());
  LoaderSpec s = spec_for(2, 8, 1, 0, /*seed=*/99);
  PrefetchLoader a(ds, s, options(true, 3)), b(ds, s, options(true, 1));
  LoaderSpec other = s;
  other.seed = 100;
  PrefetchLoader c(ds, other, options(true, 3));
  const std::vector<Micro> sa = drain(a, s, 20), sb = drain(b, s, 20), sc = drain(c, s, 20);
  EXPECT_TRUE(sa == sb);
  EXPECT_FALSE(sa == sc);
}

TEST(Loader, ResumesMidEpochExactly) {
  TokenDataset ds = make_dataset(fresh_dir());
  // GB = 12: step 3 starts at global sample 36, in the middle of the first epoch.
  LoaderSpec s = spec_for(2, 12, 2, 0);
  const int64_t resume = 3, steps = 10;  // runs into the second and third epochs
  PrefetchLoader whole(ds, s, options(true, 2));
  std::vector<Micro> uninterrupted = drain(whole, s, resume + steps);
  uninterrupted.erase(uninterrupted.begin(), uninterrupted.begin() + resume * s.microbatches);
  for (bool enabled : {true, false}) {
    LoaderSpec r = s;
    r.first_step = resume;
    PrefetchLoader resumed(ds, r, options(enabled, 3));
    EXPECT_EQ(resumed.next_step(), resume);
    EXPECT_TRUE(drain(resumed, r, steps) == uninterrupted) << "enabled=" << enabled;
  }
}

// Consumes 5 warm-up and then 20 measured microbatches, "computing" 60 ms
// each; returns what the measured ones waited.
struct Waited {
  double wait_ms = 0;     // blocked in next(), in all
  double elapsed_ms = 0;  // the 20 calls and their compute
  int64_t blocked = 0;    // calls that blocked
};
Waited measure_waits(bool enabled, LoaderStats* st) {
  TokenDataset ds = make_dataset(fresh_dir(enabled ? "on" : "off"));
  LoaderSpec s = spec_for(/*B=*/1, /*GB=*/4, 1, 0);
  LoaderOptions o = options(enabled, /*threads=*/2, 2, 8);
  o.read_delay_ms = 20;
  PrefetchLoader loader(ds, s, o);
  std::vector<int32_t> tokens(kT), targets(kT);
  int64_t seq = 0;
  auto one = [&] {
    loader.next(seq / s.microbatches, int(seq % s.microbatches), tokens.data(), targets.data());
    ++seq;
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
  };
  for (int i = 0; i < 5; ++i) one();
  loader.take_wait_ms();
  const int64_t blocked_before = loader.stats().waits;
  Stopwatch sw;
  for (int i = 0; i < 20; ++i) one();
  Waited w{loader.take_wait_ms(), sw.ms(), 0};
  *st = loader.stats();
  w.blocked = st->waits - blocked_before;
  std::printf("[ loader   ] prefetch %s: waited %.2f ms of %.1f ms (%.2f%%) in %lld of 20 calls, depth %d, load %.1f ms, "
              "interval %.1f ms\n",
              enabled ? "on " : "off", w.wait_ms, w.elapsed_ms, 100 * w.wait_ms / w.elapsed_ms, (long long)w.blocked,
              st->depth, st->mean_load_ms, st->mean_consume_interval_ms);
  return w;
}

// The bounds are counts and sleeps, not shares of wall time, so that a
// loaded machine cannot break them: with 40 ms of slack per microbatch a
// prefetching consumer blocks only when a worker was starved that long
// (two such calls of 20 are allowed); reading on demand blocks on every
// call for at least the injected 20 ms.
TEST(Prefetch, HidesSlowReads) {
  LoaderStats st;
  const Waited on = measure_waits(true, &st);
  EXPECT_LE(on.blocked, 2) << "prefetching left the consumer waiting in " << on.blocked << " of 20 calls";
  // Load 20 ms against 60 ms of compute needs one read in flight: depth stays small.
  EXPECT_LE(st.depth, 3);
  EXPECT_GE(st.mean_load_ms, 19.0);
  EXPECT_GE(st.mean_consume_interval_ms, 55.0);
  const Waited off = measure_waits(false, &st);
  EXPECT_EQ(off.blocked, 20);
  EXPECT_EQ(st.waits, 25);
  EXPECT_GE(off.wait_ms, 20 * 20.0 * 0.95) << "reading on demand did not wait out the injected delays";
  EXPECT_LT(on.wait_ms, 0.15 * off.wait_ms) << "prefetching hid less than 85% of the reads";
}

TEST(Prefetch, DepthGrowsForAFastConsumer) {
  TokenDataset ds = make_dataset(fresh_dir());
  LoaderSpec s = spec_for(1, 4, 1, 0);
  LoaderOptions o = options(true, 4, /*pmin=*/2, /*pmax=*/6);
  o.read_delay_ms = 3;
  PrefetchLoader loader(ds, s, o);
  EXPECT_EQ(loader.depth(), 2);  // starts at prefetch_min
  drain(loader, s, 10);          // the consumer comes straight back: reads are the bottleneck
  EXPECT_EQ(loader.depth(), 6);
  EXPECT_EQ(loader.stats().depth, 6);
}

TEST(Loader, WorkerErrorSurfacesInNext) {
  TokenDataset ds = make_dataset(fresh_dir());
  LoaderSpec s = spec_for(2, 4, 1, 0);  // m = 2
  SequenceSampler sampler(ds, kT, s.seed);
  for (bool enabled : {true, false}) {
    SCOPED_TRACE(testing::Message() << "enabled=" << enabled);
    LoaderOptions o = options(enabled, 3);
    o.fail_after = 5;
    PrefetchLoader loader(ds, s, o);
    std::vector<int32_t> tokens(2 * kT), targets(2 * kT);
    for (int i = 0; i < 5; ++i) {  // everything before the failure is delivered, in order
      loader.next(i / 2, i % 2, tokens.data(), targets.data());
      EXPECT_EQ(tokens, reference(sampler, s, i / 2, i % 2).tokens);
    }
    for (int again = 0; again < 2; ++again) {
      try {
        loader.next(2, 1, tokens.data(), targets.data());
        ADD_FAILURE() << "next() did not throw";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::Data);
        EXPECT_NE(std::string(e.what()).find("step 2 microbatch 1"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(Loader, RejectsOutOfOrderAndBadSpecs) {
  TokenDataset ds = make_dataset(fresh_dir());
  LoaderSpec s = spec_for(2, 8, 2, 1);  // m = 2
  PrefetchLoader loader(ds, s, options(true, 2));
  std::vector<int32_t> tokens(2 * kT);
  try {
    loader.next(0, 1, tokens.data(), nullptr);
    ADD_FAILURE() << "out-of-order next() did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Internal);
  }
  loader.next(0, 0, tokens.data(), nullptr);  // the refused call consumed nothing

  auto kind_of = [&](LoaderSpec sp, LoaderOptions o) {
    try {
      PrefetchLoader l(ds, sp, o);
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::Usage;  // "did not throw"
  };
  LoaderSpec bad = s;
  bad.microbatches = 3;  // 2 x 2 x 3 != 8
  EXPECT_EQ(kind_of(bad, options(true, 2)), ErrorKind::Config);
  bad = s;
  bad.dp_rank = 2;
  EXPECT_EQ(kind_of(bad, options(true, 2)), ErrorKind::Config);
  EXPECT_EQ(kind_of(s, options(true, 2, 4, 3)), ErrorKind::Config);
  bad = s;
  bad.seq_len = int(kTokens);  // not one sample of seq_len + 1 tokens
  EXPECT_EQ(kind_of(bad, options(true, 2)), ErrorKind::Data);
}

TEST(Loader, DestroysPromptlyWhenQueueIsFull) {
  TokenDataset ds = make_dataset(fresh_dir());
  LoaderSpec s = spec_for(2, 8, 1, 0);
  within_5s([&] {
    PrefetchLoader loader(ds, s, options(true, 3, 2, 4));
    std::vector<int32_t> tokens(2 * kT), targets(2 * kT);
    loader.next(0, 0, tokens.data(), targets.data());
    // Let the workers fill every slot and block on a full queue.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  });
}

TEST(Loader, DestroysPromptlyDuringSlowReads) {
  TokenDataset ds = make_dataset(fresh_dir());
  LoaderSpec s = spec_for(1, 4, 1, 0);
  // Consume one microbatch while the other workers sit in their delays, then destroy.
  within_5s([&] {
    LoaderOptions o = options(true, 3);
    o.read_delay_ms = 100;
    PrefetchLoader loader(ds, s, o);
    std::vector<int32_t> tokens(kT), targets(kT);
    loader.next(0, 0, tokens.data(), targets.data());
  });
  // A 60 s delay per read: destruction must cut the delays short, not wait them out.
  within_5s([&] {
    LoaderOptions o = options(true, 3);
    o.read_delay_ms = 60000;
    Stopwatch sw;
    { PrefetchLoader loader(ds, s, o); }
    EXPECT_LT(sw.ms(), 1000.0);
  });
}

}  // namespace
}  // namespace xirang
