// Tests for runtime/step/grad_sync.h: GradSync run directly on a flat list
// of F32 parameters, each data-parallel rank a thread over a simulated link
// (tests/support/thread_group.h under comm/simulated_link.h). What the
// ranks put on the wire shows the buckets (their ranges of the flat
// gradient buffer) and the order they are launched in. Values are random
// multiples of 1/64, so the sums over ranks and the update below are exact
// in float and compare bitwise with a plain sum.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "comm/simulated_link.h"
#include "core/rng.h"
#include "core/step_clock.h"
#include "runtime/config/config.h"
#include "runtime/step/grad_sync.h"
#include "runtime/step/optimizer.h"
#include "tests/support/clock_probe.h"
#include "tests/support/thread_group.h"

namespace xirang {
namespace {

constexpr uint64_t kSeed = 5;
constexpr int64_t kBlock = Arena::kAlignment / sizeof(float);  // an F32 allocation's granule

struct Spec {
  int64_t numel;
  int layer;
};

// Parameters and gradients carved in order from two arenas, as a chunk lays them out.
struct FlatModel {
  Arena values, grads;
  std::vector<Parameter> params;
  explicit FlatModel(const std::vector<Spec>& specs) {
    for (size_t i = 0; i < specs.size(); ++i)
      params.push_back(Parameter{str_cat("p", i), Tensor(), Tensor(), i % 2 == 0, specs[i].layer,
                                 ShardSpec::whole({specs[i].numel}), false, false, InitRule::zeros()});
    Arena mv = Arena::measuring("values"), mg = Arena::measuring("grads");
    for (const Spec& s : specs) mv.alloc({s.numel}, DType::F32, "v"), mg.alloc({s.numel}, DType::F32, "g");
    values = Arena("values", mv.used());
    grads = Arena("grads", mg.used());
    std::memset(values.base(), 0, values.used());
    std::memset(grads.base(), 0, grads.used());
    for (size_t i = 0; i < specs.size(); ++i) {
      params[i].value = values.alloc({specs[i].numel}, DType::F32, "v");
      params[i].grad = grads.alloc({specs[i].numel}, DType::F32, "g");
    }
  }
  int64_t offset(size_t i) const {
    return (static_cast<char*>(params[i].value.raw()) - static_cast<char*>(values.base())) / int64_t(sizeof(float));
  }
};

// A nonzero multiple of 1/64 in (-2, 2): element e of parameter i (of rank r's gradient, or the initial value).
float dyadic(uint64_t stream, size_t i, int64_t e) {
  const auto k = double(rng_below(kSeed, stream * 131 + i, uint64_t(e), 127) + 1);
  return float((rng_below(kSeed, stream * 131 + i + 7, uint64_t(e), 2) ? k : -k) / 64.0);
}
float grad_of(int rank, size_t i, int64_t e) { return dyadic(uint64_t(rank) + 1, i, e); }
float value_of(size_t i, int64_t e) { return dyadic(0, i, e); }

// The buckets as the header states them, written out independently: from
// the end of the flat buffer (padded to the allocation granule), each
// bucket takes whole parameters until it spans at least `elems`.
std::vector<std::pair<int64_t, int64_t>> expected_buckets(const FlatModel& f, int64_t elems) {
  const size_t n = f.params.size();
  int64_t end = (f.offset(n - 1) + f.params.back().value.numel() + kBlock - 1) / kBlock * kBlock;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t k = n; k-- > 0;)
    if (end - f.offset(k) >= elems || k == 0) {
      out.emplace_back(f.offset(k), end);
      end = f.offset(k);
    }
  return out;
}

double bucket_mb(int64_t elems) { return double(elems) * sizeof(float) / (1024.0 * 1024.0); }

// One operation a rank put on the wire: its range of the flat buffer and the step clock's part.
struct Wire {
  CommEvent::Kind kind;
  bool wait;
  int64_t begin, end;  // elements of the flat gradient (all-gather: parameter) buffer
  std::optional<StepPart> part;
};

struct Layout {
  int dp;
  bool zero, overlap;
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << "dp=" << l.dp << " zero=" << l.zero << " overlap=" << l.overlap;
}

std::string layout_name(const testing::TestParamInfo<Layout>& info) {
  return str_cat("dp", info.param.dp, info.param.zero ? "_zero" : "", info.param.overlap ? "_overlap" : "");
}

// Parameters in forward order with their layers: padding (30, 7, 100 are
// not multiples of the granule), a bucket boundary at exactly the bucket
// size, and layers whose hook completes one, none or two buckets.
const std::vector<Spec> kSpecs = {{100, -1}, {64, 0}, {64, 0}, {30, 1}, {64, 1}, {192, 2}, {7, 3}};
constexpr int64_t kBucket = 128;

// dp ranks, each with its model, link, clock and GradSync; run() drives a step.
class DataParallel {
 public:
  DataParallel(const std::vector<Spec>& specs, int dp, GradSyncOptions opts) : world_(dp, 10.0) {
    for (int r = 0; r < dp; ++r) {
      auto R = std::make_unique<Rank>(specs);
      for (size_t i = 0; i < R->model.params.size(); ++i) {
        Parameter& p = R->model.params[i];
        for (int64_t e = 0; e < p.value.numel(); ++e) {
          p.value.data<float>()[e] = value_of(i, e);
          p.grad.data<float>()[e] = grad_of(r, i, e);
        }
      }
      R->link = std::make_unique<SimulatedLink>(world_.comm(r, "dp"), LinkModel{.latency_us = 50}, 10.0);
      R->sync = std::make_unique<GradSync>(R->model.params, *R->link, nullptr, nullptr, opts);
      Arena ms = Arena::measuring("shard");
      R->sync->layout(ms);
      R->shard = Arena("shard", ms.used());
      R->sync->layout(R->shard);
      R->sync->set_clock(&R->clock);
      Rank* raw = R.get();
      world_.set_observer(r, [raw](const CommEvent& e) {
        const bool gather = e.kind == CommEvent::AllGather;
        const Tensor& t = gather ? e.out : e.tensor;
        const char* base = static_cast<const char*>(gather ? raw->model.values.base() : raw->model.grads.base());
        const int64_t b = (static_cast<const char*>(t.raw()) - base) / int64_t(sizeof(float));
        raw->wire.push_back({e.kind, e.wait, b, b + t.numel(), open_part(&raw->clock)});
        raw->wire_at_hook.push_back(raw->hooks_done);
      });
      ranks_.push_back(std::move(R));
    }
  }

  // One step: the hooks fire in backward order inside a backward part
  // (`layers`, from the last), then finish, a plain SGD update of each
  // optimizer segment (p -= g / 2), and the ZeRO gather.
  void run(const std::vector<int>& layers) {
    run_ranks(world_.size(), [&](int r) {
      Rank& R = *ranks_[size_t(r)];
      R.clock.start();
      R.sync->begin_step();
      for (int l : layers) {
        StepClock::Scope backward(&R.clock, StepPart::Backward);
        R.sync->layer_done(l);
        ++R.hooks_done;
      }
      R.sync->finish();
      for (const OptimizerSegment& s : R.sync->optimizer_segments()) {
        float* p = s.param.data<float>();
        const float* g = s.grad.data<float>();
        for (int64_t e = 0; e < s.param.numel(); ++e) p[e] -= g[e] / 2;
      }
      R.sync->gather_parameters();
      R.clock.stop();
    });
  }

  struct Rank {
    explicit Rank(const std::vector<Spec>& specs) : model(specs) {}
    FlatModel model;
    std::unique_ptr<SimulatedLink> link;
    std::unique_ptr<GradSync> sync;
    Arena shard;
    StepClock clock;
    std::vector<Wire> wire;
    std::vector<int> wire_at_hook;  // hooks done when each wire event happened
    int hooks_done = 0;
  };
  Rank& rank(int r) { return *ranks_[size_t(r)]; }
  int dp() const { return world_.size(); }

 private:
  ThreadWorld world_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

// The layers of kSpecs from the last, as a backward pass completes them.
const std::vector<int> kBackward = {3, 2, 1, 0, -1};

TEST(GradSyncBuckets, TileTheBufferFromItsEndClosingAtExactlyTheBucketSize) {
  // Spans from the end: 192 (closes), 64 + 64 = 128 (exactly the size: closes), 64 + 64, 128.
  DataParallel one({{128, -1}, {64, 0}, {64, 0}, {64, 1}, {64, 1}, {192, 2}}, 1,
                   {.bucket_mb = bucket_mb(128), .overlap = false, .zero = false});
  EXPECT_EQ(one.rank(0).sync->num_buckets(), 4);
  one.run({2, 1, 0, -1});
  std::vector<std::pair<int64_t, int64_t>> got;
  for (const Wire& w : one.rank(0).wire)
    if (!w.wait && w.kind == CommEvent::AllReduce) got.emplace_back(w.begin, w.end);
  const std::vector<std::pair<int64_t, int64_t>> want = {{384, 576}, {256, 384}, {128, 256}, {0, 128}};
  EXPECT_EQ(got, want);
  EXPECT_EQ(expected_buckets(one.rank(0).model, 128), want);
}

TEST(GradSyncBuckets, TileTheBufferWithItsPadding) {
  DataParallel one(kSpecs, 1, {.bucket_mb = bucket_mb(kBucket), .overlap = false, .zero = false});
  one.run(kBackward);
  std::vector<std::pair<int64_t, int64_t>> got;
  for (const Wire& w : one.rank(0).wire)
    if (!w.wait && w.kind == CommEvent::AllReduce) got.emplace_back(w.begin, w.end);
  const auto want = expected_buckets(one.rank(0).model, kBucket);
  EXPECT_EQ(got, want);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.back().first, 0);
  for (size_t k = 1; k < got.size(); ++k) EXPECT_EQ(got[k].second, got[k - 1].first) << "a gap before bucket " << k;
  EXPECT_EQ(got.front().second % kBlock, 0);
}

// A hook launches every bucket it completes, in bucket order, and nothing
// else; layer 2 (the 192 elements and the 64 + 30 before them) completes
// two buckets, layer 0 none.
TEST(GradSyncBuckets, HooksLaunchTheBucketsTheyCompleteInOrder) {
  const std::vector<Spec> specs = {{128, -1}, {64, 0}, {64, 1}, {64, 2}, {64, 2}, {192, 2}};
  DataParallel two(specs, 2, {.bucket_mb = bucket_mb(128), .overlap = true, .zero = false});
  two.run({2, 1, 0, -1});
  for (int r = 0; r < 2; ++r) {
    std::vector<std::pair<int, std::pair<int64_t, int64_t>>> got;  // (hooks done before the launch, range)
    auto& R = two.rank(r);
    for (size_t i = 0; i < R.wire.size(); ++i)
      if (!R.wire[i].wait && R.wire[i].kind == CommEvent::AllReduce)
        got.push_back({R.wire_at_hook[i], {R.wire[i].begin, R.wire[i].end}});
    const std::vector<std::pair<int, std::pair<int64_t, int64_t>>> want = {
        {0, {384, 576}}, {0, {256, 384}}, {2, {128, 256}}, {3, {0, 128}}};  // layer 2: two; layer 1: none
    EXPECT_EQ(got, want) << "rank " << r;
  }
}

class GradSyncLayouts : public testing::TestWithParam<Layout> {
 protected:
  GradSyncOptions options() const {
    return {.bucket_mb = bucket_mb(kBucket), .overlap = GetParam().overlap, .zero = GetParam().zero};
  }
};

// The ranks reduce the same buckets in the same order: the expected buckets
// (all-reduce, or reduce-scatter under ZeRO), then under ZeRO the gather of
// the same ranges; launches and waits are exposed dp communication.
TEST_P(GradSyncLayouts, PutsTheBucketsOnTheWireInOrder) {
  DataParallel dp(kSpecs, GetParam().dp, options());
  dp.run(kBackward);
  const auto buckets = expected_buckets(dp.rank(0).model, kBucket);
  const CommEvent::Kind reduce = GetParam().zero ? CommEvent::ReduceScatter : CommEvent::AllReduce;
  for (int r = 0; r < dp.dp(); ++r) {
    std::vector<std::pair<int64_t, int64_t>> reduced, gathered;
    for (const Wire& w : dp.rank(r).wire) {
      EXPECT_EQ(part_name(w.part), part_name(StepPart::DpCommExposed)) << "rank " << r << ", kind " << w.kind;
      if (w.wait) continue;
      if (w.kind == reduce) reduced.emplace_back(w.begin, w.end);
      else if (w.kind == CommEvent::AllGather) gathered.emplace_back(w.begin, w.end);
      else ADD_FAILURE() << "rank " << r << ": unexpected operation " << w.kind;
    }
    EXPECT_EQ(reduced, buckets) << "rank " << r;
    EXPECT_EQ(gathered, GetParam().zero ? buckets : decltype(buckets){}) << "rank " << r;
  }
}

// Each rank's reduced gradients equal the plain sum over ranks: all of
// them, or under ZeRO those of its segments.
TEST_P(GradSyncLayouts, ReducedGradientsEqualThePlainSum) {
  DataParallel dp(kSpecs, GetParam().dp, options());
  dp.run(kBackward);
  for (int r = 0; r < dp.dp(); ++r) {
    auto& R = dp.rank(r);
    int64_t checked = 0;
    for (const OptimizerSegment& s : R.sync->optimizer_segments()) {
      const size_t i = size_t(s.param_index);
      for (int64_t e = 0; e < s.grad.numel(); ++e) {
        float sum = 0;
        for (int q = 0; q < dp.dp(); ++q) sum += grad_of(q, i, s.param_offset + e);
        ASSERT_EQ(s.grad.data<float>()[e], sum) << "rank " << r << ", parameter " << i << ", element " << s.param_offset + e;
      }
      checked += s.grad.numel();
    }
    EXPECT_GT(checked, 0) << "rank " << r;
  }
}

// Without ZeRO a segment is a whole parameter; with it, the segments are
// this rank's chunk of each bucket cut at parameter boundaries: over the
// ranks every element of every parameter is in exactly one segment, none
// is empty, and each lies in its rank's chunk of its bucket.
TEST_P(GradSyncLayouts, SegmentsCoverEveryElementOnce) {
  DataParallel dp(kSpecs, GetParam().dp, options());
  const FlatModel& f0 = dp.rank(0).model;
  const auto buckets = expected_buckets(f0, kBucket);
  std::vector<std::vector<int>> covered(f0.params.size());
  for (size_t i = 0; i < f0.params.size(); ++i) covered[i].assign(size_t(f0.params[i].value.numel()), 0);
  for (int r = 0; r < dp.dp(); ++r) {
    auto& R = dp.rank(r);
    int64_t shard = 0;  // this rank's chunks of the buckets, padding included: the ZeRO shard's size
    for (const auto& [b0, b1] : buckets) shard += (b1 - b0) * (r + 1) / dp.dp() - (b1 - b0) * r / dp.dp();
    for (const OptimizerSegment& s : R.sync->optimizer_segments()) {
      const size_t i = size_t(s.param_index);
      const Parameter& p = R.model.params[i];
      ASSERT_GT(s.param.numel(), 0) << "rank " << r << ": an empty segment of parameter " << i;
      ASSERT_EQ(s.grad.numel(), s.param.numel());
      EXPECT_EQ(s.param.raw(), static_cast<void*>(p.value.data<float>() + s.param_offset)) << "rank " << r;
      EXPECT_EQ(s.decay, p.decay);
      const int64_t b = R.model.offset(i) + s.param_offset, e = b + s.param.numel();
      ASSERT_LE(e, R.model.offset(i) + p.value.numel()) << "rank " << r << ": segment past parameter " << i;
      if (GetParam().zero) {
        bool inside = false;
        for (const auto& [b0, b1] : buckets) {
          const int64_t c0 = b0 + (b1 - b0) * r / dp.dp(), c1 = b0 + (b1 - b0) * (r + 1) / dp.dp();
          inside = inside || (c0 <= b && e <= c1);
        }
        EXPECT_TRUE(inside) << "rank " << r << ": segment [" << b << ", " << e << ") outside its chunks";
      } else {
        EXPECT_EQ(s.param_offset, 0);
        EXPECT_EQ(s.param.numel(), p.value.numel());
      }
      for (int64_t k = s.param_offset; k < s.param_offset + s.param.numel(); ++k) ++covered[i][size_t(k)];
    }
    EXPECT_EQ(R.sync->shard_elements(), GetParam().zero ? shard : 0) << "rank " << r;
  }
  for (size_t i = 0; i < covered.size(); ++i) {
    const int want = GetParam().zero ? 1 : dp.dp();
    for (size_t k = 0; k < covered[i].size(); ++k)
      ASSERT_EQ(covered[i][k], want) << "parameter " << i << ", element " << k;
  }
}

// After the update of each rank's segments (and under ZeRO the gather),
// every rank holds every parameter updated with the summed gradient.
TEST_P(GradSyncLayouts, EveryRankHoldsTheUpdateAfterTheGather) {
  DataParallel dp(kSpecs, GetParam().dp, options());
  dp.run(kBackward);
  for (int r = 0; r < dp.dp(); ++r) {
    const FlatModel& f = dp.rank(r).model;
    for (size_t i = 0; i < f.params.size(); ++i)
      for (int64_t e = 0; e < f.params[i].value.numel(); ++e) {
        float sum = 0;
        for (int q = 0; q < dp.dp(); ++q) sum += grad_of(q, i, e);
        ASSERT_EQ(f.params[i].value.data<float>()[e], value_of(i, e) - sum / 2)
            << "rank " << r << ", parameter " << i << ", element " << e;
      }
  }
}

// The global norm: the square root of the summed gradients' squares, however they are sharded.
TEST_P(GradSyncLayouts, GradientNormIsThatOfThePlainSum) {
  DataParallel dp(kSpecs, GetParam().dp, options());
  double want = 0;
  for (size_t i = 0; i < kSpecs.size(); ++i)
    for (int64_t e = 0; e < kSpecs[i].numel; ++e) {
      float sum = 0;
      for (int q = 0; q < dp.dp(); ++q) sum += grad_of(q, i, e);
      want += double(sum) * sum;
    }
  std::vector<double> norms(size_t(dp.dp()));
  run_ranks(dp.dp(), [&](int r) {
    auto& R = dp.rank(r);
    AdamW opt(TrainConfig{});
    opt.set_segments(R.sync->optimizer_segments());
    R.sync->begin_step();
    for (int l : kBackward) R.sync->layer_done(l);
    R.sync->finish();
    norms[size_t(r)] = R.sync->grad_norm(KernelContext{}, opt);
  });
  for (int r = 0; r < dp.dp(); ++r) EXPECT_NEAR(norms[size_t(r)], std::sqrt(want), 1e-12 * std::sqrt(want)) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Step, GradSyncLayouts,
                         testing::Values(Layout{1, false, true}, Layout{1, true, true}, Layout{2, false, true},
                                         Layout{2, false, false}, Layout{2, true, true}, Layout{2, true, false},
                                         Layout{3, true, true}, Layout{4, false, true}, Layout{4, true, true},
                                         Layout{4, true, false}),
                         layout_name);

}  // namespace
}  // namespace xirang
