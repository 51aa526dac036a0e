// Tests for core/timeline.h on the host: OpScope's per-kind sums (nested
// scopes counted once, nothing recorded when profiling is off or there is
// no timeline, take_ops() starting a new count), add_op_later() evaluated
// at take time, and SpanScope (only while tracing, end() before the scope
// ends, open spans counted until they end, spans added from another thread).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "core/clock.h"
#include "core/timeline.h"

namespace xirang {
namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

int64_t total_calls(const OpTimes& t) {
  int64_t n = 0;
  for (int64_t c : t.calls) n += c;
  return n;
}

TEST(TimelineTest, OpScopeTimesTheCallOnTheHost) {
  Timeline tl;
  tl.set_profiling(true);
  {
    OpScope op(&tl, nullptr, OpKind::Attention);
    sleep_ms(5);
  }
  { OpScope op(&tl, nullptr, OpKind::Attention); }
  const OpTimes t = tl.take_ops();
  EXPECT_EQ(t.calls[size_t(OpKind::Attention)], 2);
  EXPECT_EQ(total_calls(t), 2);
  EXPECT_GE(t.ms[size_t(OpKind::Attention)], 5.0 * 0.99);  // sleep_for sleeps at least as long
  EXPECT_LT(t.ms[size_t(OpKind::Attention)], 5000.0);
}

TEST(TimelineTest, NestedScopesCountTheOutermostOnly) {
  Timeline tl;
  tl.set_profiling(true);
  {
    OpScope outer(&tl, nullptr, OpKind::Matmul);
    {
      OpScope inner(&tl, nullptr, OpKind::Elementwise);
      OpScope innermost(&tl, nullptr, OpKind::Norm);
      sleep_ms(3);
    }
    OpScope second(&tl, nullptr, OpKind::Elementwise);
  }
  { OpScope after(&tl, nullptr, OpKind::Elementwise); }  // depth back at 0: counted
  const OpTimes t = tl.take_ops();
  EXPECT_EQ(t.calls[size_t(OpKind::Matmul)], 1);
  EXPECT_EQ(t.calls[size_t(OpKind::Elementwise)], 1);
  EXPECT_EQ(t.calls[size_t(OpKind::Norm)], 0);
  EXPECT_EQ(t.ms[size_t(OpKind::Norm)], 0.0);
  EXPECT_GE(t.ms[size_t(OpKind::Matmul)], 3.0 * 0.99);  // the inner ops' time is the outer op's
  EXPECT_EQ(tl.op_depth(), 0);
}

TEST(TimelineTest, NothingWithoutProfilingOrTimeline) {
  Timeline tl;  // profiling off by default
  EXPECT_FALSE(tl.profiling());
  { OpScope op(&tl, nullptr, OpKind::Matmul); }
  tl.add_op_later(OpKind::DpAllReduce, [] { return 1.0; });
  { OpScope op(nullptr, nullptr, OpKind::Matmul); }  // no timeline: a no-op, no crash
  EXPECT_EQ(tl.op_depth(), 0);
  const OpTimes t = tl.take_ops();
  EXPECT_EQ(total_calls(t), 0);
  for (double ms : t.ms) EXPECT_EQ(ms, 0.0);
  // Tracing alone does not profile.
  tl.set_tracing(true);
  { OpScope op(&tl, nullptr, OpKind::Matmul); }
  EXPECT_EQ(total_calls(tl.take_ops()), 0);
}

TEST(TimelineTest, TakeOpsStartsANewCount) {
  Timeline tl;
  tl.set_profiling(true);
  tl.add_op_ms(OpKind::Loss, 2.5);
  tl.add_op_ms(OpKind::Loss, 0.5);
  const OpTimes first = tl.take_ops();
  EXPECT_EQ(first.calls[size_t(OpKind::Loss)], 2);
  EXPECT_DOUBLE_EQ(first.ms[size_t(OpKind::Loss)], 3.0);
  const OpTimes second = tl.take_ops();
  EXPECT_EQ(total_calls(second), 0);
  EXPECT_EQ(second.ms[size_t(OpKind::Loss)], 0.0);
}

TEST(TimelineTest, LaterTimesAreReadAtTake) {
  Timeline tl;
  tl.set_profiling(true);
  int reads = 0;
  double ms = -1;  // not known yet when added
  tl.add_op_later(OpKind::PpSend, [&] {
    ++reads;
    return ms;
  });
  tl.add_op_later(OpKind::PpSend, [&] {
    ++reads;
    return 1.0;
  });
  EXPECT_EQ(reads, 0);
  ms = 4.0;  // the transfer completes
  const OpTimes t = tl.take_ops();
  EXPECT_EQ(reads, 2);
  EXPECT_EQ(t.calls[size_t(OpKind::PpSend)], 2);
  EXPECT_DOUBLE_EQ(t.ms[size_t(OpKind::PpSend)], 5.0);
  EXPECT_EQ(total_calls(tl.take_ops()), 0);  // read once, then dropped
  EXPECT_EQ(reads, 2);
}

TEST(TimelineTest, KindNamesAndGroups) {
  EXPECT_STREQ(op_kind_name(OpKind::Matmul), "matmul");
  EXPECT_STREQ(op_kind_name(OpKind::Optimizer), "optimizer");
  EXPECT_STREQ(op_kind_name(OpKind::TpAllReduce), "tp_all_reduce");
  EXPECT_STREQ(op_kind_name(OpKind::TiedAllReduce), "tied_all_reduce");
  for (int k = 0; k < kOpKindCount; ++k) {
    EXPECT_EQ(op_kind_is_comm(OpKind(k)), k >= int(OpKind::TpAllReduce)) << op_kind_name(OpKind(k));
    for (int j = 0; j < k; ++j) EXPECT_STRNE(op_kind_name(OpKind(k)), op_kind_name(OpKind(j)));
  }
}

TEST(TimelineTest, SpansOnlyWhileTracing) {
  Timeline tl;
  { SpanScope s(&tl, "forward"); }
  add_span(&tl, "wait", Track::Main, 1.0, 2.0);
  { SpanScope s(nullptr, "forward"); }
  EXPECT_TRUE(tl.take_spans().empty());
  tl.set_tracing(true);
  { SpanScope s(&tl, "backward", Track::Main, 3, 1, 7); }
  add_span(&tl, "send", Track::PipeSend, 1.0, 2.0, 2, 0, -1, 4096);
  tl.set_tracing(false);
  { SpanScope s(&tl, "forward"); }
  const auto spans = tl.take_spans();
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_STREQ(spans[0].name, "backward");
  EXPECT_EQ(spans[0].microbatch, 3);
  EXPECT_EQ(spans[0].chunk, 1);
  EXPECT_EQ(spans[0].index, 7);
  EXPECT_LE(spans[0].t0, spans[0].t1);
  EXPECT_STREQ(spans[1].name, "send");
  EXPECT_EQ(spans[1].track, Track::PipeSend);
  EXPECT_EQ(spans[1].bytes, 4096);
  EXPECT_DOUBLE_EQ(spans[1].t1, 2.0);
  EXPECT_TRUE(tl.take_spans().empty());  // taken
}

TEST(TimelineTest, EndFinishesTheSpanEarly) {
  Timeline tl;
  tl.set_tracing(true);
  double ended = 0;
  {
    SpanScope s(&tl, "optimizer");
    EXPECT_EQ(tl.open_spans(), 1);
    s.end();
    EXPECT_EQ(tl.open_spans(), 0);
    ended = now_seconds();
    sleep_ms(20);
    s.end();  // a second end adds nothing
  }
  EXPECT_EQ(tl.open_spans(), 0);
  const auto spans = tl.take_spans();
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_LE(spans[0].t1, ended);  // not the scope's end, 20 ms later
}

TEST(TimelineTest, SpansFromAnotherThreadLand) {
  Timeline tl;
  tl.set_tracing(true);
  std::thread writer([&] {
    for (int i = 0; i < 100; ++i) SpanScope s(&tl, "write", Track::Checkpoint, -1, -1, i);
  });
  for (int i = 0; i < 100; ++i) SpanScope s(&tl, "step", Track::Main, -1, -1, i);
  writer.join();
  const auto spans = tl.take_spans();
  ASSERT_EQ(spans.size(), 200u);
  int writes = 0;
  for (const Span& s : spans)
    if (s.track == Track::Checkpoint) {
      EXPECT_STREQ(s.name, "write");
      ++writes;
    }
  EXPECT_EQ(writes, 100);
}

}  // namespace
}  // namespace xirang
