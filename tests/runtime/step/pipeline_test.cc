// Tests for runtime/step/pipeline.h: the executor run directly, every
// pipeline rank a thread, on AffineChunks (affine_chunk.h) over a simulated
// link (tests/support/thread_group.h under comm/simulated_link.h). For each
// schedule:
// - the passes, the receive waits and the sends run in the instruction
//   list's order, each pass on the microbatch the list names (the data carry
//   their microbatch);
// - receives are posted ahead: two at most outstanding, and the next one
//   is posted before the current one is waited for;
// - an activation slot is written only after the send reading it was joined,
//   and the step ends only when every send has been joined (drain);
// - each wait and pass is charged to its part of the step clock;
// - the losses and gradients equal a one-rank run's bitwise (zb_h1 also
//   equals 1F1B's).
// Nothing here says when zb_h1 frees an activation slot: the chunk keeps what
// a weight part needs outside the slot, so either moment is right.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <ostream>
#include <optional>
#include <string>
#include <vector>

#include "comm/simulated_link.h"
#include "core/step_clock.h"
#include "runtime/step/pipeline.h"
#include "runtime/step/schedule.h"
#include "runtime/config/schedule_rules.h"
#include "tests/runtime/step/affine_chunk.h"
#include "tests/support/clock_probe.h"
#include "tests/support/thread_group.h"

namespace xirang {
namespace {

constexpr int kLayersPerChunk = 2, kWidth = 3, kB = 2, kT = 2;
constexpr uint64_t kSeed = 11;
constexpr double kDloss = 0.125;
constexpr int kLookahead = 2;  // the executor's receives posted ahead (pipeline.cc)
constexpr int kSteps = 2;      // the second step reuses every slot and buffer of the first

// Microbatch mb of step `step`: tokens[0] = targets[0] = mb (its label), the rest random in [0, 8).
void fill(int step, int mb, const Tensor& tokens, const Tensor& targets) {
  for (const Tensor* t : {&tokens, &targets}) {
    if (!t->defined()) continue;
    int32_t* p = t->data<int32_t>();
    const uint64_t stream = uint64_t(step * 1000 + mb) * 2 + (t == &targets);
    for (int64_t i = 0; i < t->numel(); ++i) p[i] = i == 0 ? mb : int32_t(rng_below(kSeed, stream, uint64_t(i), 8));
  }
}

struct PipeCase {
  ScheduleKind kind;
  int p, m, v;
};

void PrintTo(const PipeCase& c, std::ostream* os) {
  *os << schedule_name(c.kind) << " p=" << c.p << " m=" << c.m << " v=" << c.v;
}

std::string case_name(const testing::TestParamInfo<PipeCase>& info) {
  const PipeCase& c = info.param;
  const std::string k = schedule_name(c.kind);
  return str_cat(k == "1f1b" ? "onefoneb" : k, "_p", c.p, "_m", c.m, "_v", c.v);
}

// One thing a rank did, in its order.
struct Event {
  enum Kind { Call, PostRecv, WaitRecv, PostSend, JoinSend, Feed } kind;
  std::string what;              // the ordered events' description (Call, WaitRecv, PostSend)
  int64_t id = -1;               // the communication operation's number
  std::optional<StepPart> part;  // waits, passes and feeds: the step clock's part
};

// The results of one step on one rank.
struct StepResult {
  double loss = 0;
  std::map<std::string, std::vector<double>> grads;  // by parameter name
};

// A pipeline of p ranks running `kind`, each a thread.
class Pipeline {
 public:
  Pipeline(ScheduleKind kind, int p, int m, int v) : kind_(kind), p_(p), m_(m), v_(v), world_(p, 10.0) {
    const int n_layer = p * v * kLayersPerChunk;
    for (int r = 0; r < p; ++r) {
      auto R = std::make_unique<Rank>();
      R->list = make_schedule(kind, p, r, m, v);
      const ChunkBatch batch{.micro_batch = kB, .seq_len = kT,
                             .activation_slots = max_in_flight(R->list, v) + (p > 1 ? 2 : 0),
                             .split_backward = splits_backward(kind)};
      std::vector<ModelChunk*> raw;
      for (int c = 0; c < v; ++c) {
        R->chunks.push_back(std::make_unique<AffineChunk>(
            affine_dims(n_layer, kWidth), chunk_map(kind, p, v).placement(n_layer, r, c), batch, &R->trace));
        raw.push_back(R->chunks.back().get());
      }
      R->link = std::make_unique<SimulatedLink>(world_.comm(r, "pp"), LinkModel{.latency_us = 100}, 10.0);
      R->exec = std::make_unique<PipelineExecutor>(raw, PipeChannels::shared(*R->link), chunk_map(kind, p, v), r, m);
      Arena mp = Arena::measuring("parameters"), mg = Arena::measuring("gradients"), ma = Arena::measuring("acts");
      for (auto& c : R->chunks) c->layout_parameters(mp, mg);
      for (auto& c : R->chunks) c->layout_activations(ma);
      R->exec->layout(ma);
      R->params = Arena("parameters", mp.used());
      R->grads = Arena("gradients", mg.used());
      R->acts = Arena("acts", ma.used());
      for (auto& c : R->chunks) c->layout_parameters(R->params, R->grads);
      for (auto& c : R->chunks) c->layout_activations(R->acts);
      R->exec->layout(R->acts);
      for (auto& c : R->chunks) c->init_parameters(kSeed);
      observe(r, *R);
      ranks_.push_back(std::move(R));
    }
  }

  // Runs kSteps steps on every rank; results()[step][rank].
  void run() {
    results_.assign(size_t(kSteps), std::vector<StepResult>(size_t(p_)));
    run_ranks(p_, [&](int r) {
      Rank& R = *ranks_[size_t(r)];
      KernelContext ctx;
      ctx.clock = &R.clock;
      for (int step = 0; step < kSteps; ++step) {
        std::memset(R.grads.base(), 0, R.grads.used());
        const auto feed = [&](int mb, const Tensor& tk, const Tensor& tg) {
          R.events.push_back({Event::Feed, "", -1, open_part(&R.clock)});
          fill(step, mb, tk, tg);
        };
        R.step_begins.push_back(R.events.size());
        R.clock.start();
        R.exec->run(ctx, R.list, feed, kDloss);
        R.clock.stop();
        StepResult& out = results_[size_t(step)][size_t(r)];
        for (auto& c : R.chunks) {
          out.loss += c->take_loss(ctx);
          for (const Parameter& prm : c->parameters()) {
            const double* g = prm.grad.data<double>();
            out.grads[prm.name].assign(g, g + prm.grad.numel());
          }
        }
      }
      R.step_begins.push_back(R.events.size());
    });
  }

  struct Rank {
    std::vector<PipeInstr> list;
    AffineTrace trace;
    std::vector<std::unique_ptr<AffineChunk>> chunks;
    Arena params, grads, acts;
    std::unique_ptr<SimulatedLink> link;
    std::unique_ptr<PipelineExecutor> exec;
    StepClock clock;
    std::vector<Event> events;
    std::vector<size_t> step_begins;  // events index where each step begins, and the end
  };
  Rank& rank(int r) { return *ranks_[size_t(r)]; }
  const std::vector<std::vector<StepResult>>& results() const { return results_; }
  ThreadWorld& world() { return world_; }
  int p() const { return p_; }
  int m() const { return m_; }
  int v() const { return v_; }

  // Whether `in` moves data between two chunks of rank r (the V's turn): a copy, no transfer.
  bool local(int r, const PipeInstr& in) const {
    const ChunkMap map = chunk_map(kind_, p_, v_);
    if (in.chunk < 0) return false;
    const int g = map.model_chunk(r, in.chunk);
    const bool to_prev = in.op == PipeOp::RecvActivation || in.op == PipeOp::SendGradient;
    const bool to_next = in.op == PipeOp::SendActivation || in.op == PipeOp::RecvGradient;
    return (to_prev && g > 0 && map.rank_of(g - 1) == r) || (to_next && g + 1 < map.chunks() && map.rank_of(g + 1) == r);
  }
  // Whether rank r reads the loader (it holds the first or the last model chunk).
  bool feeds(int r) const {
    const ChunkMap map = chunk_map(kind_, p_, v_);
    return map.rank_of(0) == r || map.rank_of(map.chunks() - 1) == r;
  }

  // The ordered events a rank's list asks for: its passes, its receive waits and its sends.
  std::vector<std::string> expected(int r) {
    std::vector<std::string> out;
    for (const PipeInstr& in : rank(r).list) {
      const int g = chunk_map(kind_, p_, v_).model_chunk(r, in.chunk < 0 ? 0 : in.chunk);
      if (local(r, in)) continue;
      switch (in.op) {
        case PipeOp::RecvActivation: out.push_back(str_cat("recv_act g", g)); break;
        case PipeOp::RecvGradient: out.push_back("recv_grad"); break;
        case PipeOp::Forward: out.push_back(str_cat("F mb", in.microbatch, " g", g)); break;
        case PipeOp::Backward: out.push_back(str_cat("B mb", in.microbatch, " g", g)); break;
        case PipeOp::BackwardInput: out.push_back(str_cat("Bi mb", in.microbatch, " g", g)); break;
        case PipeOp::BackwardWeight: out.push_back(str_cat("W mb", in.microbatch, " g", g)); break;
        case PipeOp::SendActivation: out.push_back(str_cat("send_act mb", in.microbatch, " g", g)); break;
        case PipeOp::SendGradient: out.push_back(str_cat("send_grad mb", in.microbatch)); break;
        default: break;
      }
    }
    return out;
  }

 private:
  // The chunk (model index) whose slot output or input `t` is, or -1.
  int chunk_of(Rank& R, const Tensor& t, bool output) {
    for (auto& c : R.chunks)
      for (int s = 0; s < c->batch().activation_slots; ++s)
        if ((output ? c->stage_output(s) : c->stage_input(s)).raw() == t.raw())
          return chunk_map(kind_, p_, v_).model_chunk(rank_of(R), int(&c - &R.chunks[0]));
    return -1;
  }
  int rank_of(const Rank& R) const {
    for (size_t r = 0; r < ranks_.size(); ++r)
      if (ranks_[r].get() == &R) return int(r);
    return -1;
  }

  void observe(int r, Rank& R) {
    R.trace.on_call = [&R](const ChunkCall& c) {
      R.events.push_back(
          {Event::Call, str_cat(chunk_call_name(c.kind), " mb", c.microbatch, " g", c.chunk), -1, c.part});
    };
    R.trace.send_unjoined = [this, r](const Tensor& t) { return world_.send_unjoined(r, t); };
    world_.set_observer(r, [this, &R](const CommEvent& e) {
      if (e.kind == CommEvent::Recv && !e.wait) {
        R.events.push_back({Event::PostRecv, "", e.id, std::nullopt});
      } else if (e.kind == CommEvent::Recv) {
        const int g = chunk_of(R, e.tensor, false);
        const std::optional<StepPart> part = open_part(&R.clock);
        R.events.push_back({Event::WaitRecv, g >= 0 ? str_cat("recv_act g", g) : "recv_grad", e.id, part});
      } else if (e.kind == CommEvent::Send && !e.wait) {
        const int mb = int(e.tensor.data<double>()[kWidth]);  // row 0's label column
        const int g = chunk_of(R, e.tensor, true);
        R.events.push_back({Event::PostSend, g >= 0 ? str_cat("send_act mb", mb, " g", g) : str_cat("send_grad mb", mb),
                            e.id, std::nullopt});
      } else if (e.kind == CommEvent::Send) {
        R.events.push_back({Event::JoinSend, "", e.id, open_part(&R.clock)});
      }
    });
  }

  ScheduleKind kind_;
  int p_, m_, v_;
  ThreadWorld world_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<std::vector<StepResult>> results_;
};

// The one-rank run: the whole model in one chunk, each microbatch's forward then backward.
std::vector<StepResult> reference(int p, int m, int v) {
  const int n_layer = p * v * kLayersPerChunk;
  AffineChunk chunk(affine_dims(n_layer, kWidth), ChunkPlacement::whole(n_layer),
                    {.micro_batch = kB, .seq_len = kT, .activation_slots = 1}, nullptr);
  Arena mp = Arena::measuring("parameters"), mg = Arena::measuring("gradients"), ma = Arena::measuring("acts");
  chunk.layout_parameters(mp, mg);
  chunk.layout_activations(ma);
  Arena params("parameters", mp.used()), grads("gradients", mg.used()), acts("acts", ma.used());
  chunk.layout_parameters(params, grads);
  chunk.layout_activations(acts);
  chunk.init_parameters(kSeed);
  std::vector<int32_t> tokens(kB * kT), targets(kB * kT);
  const Tensor tk(tokens.data(), {kB, kT}, DType::I32), tg(targets.data(), {kB, kT}, DType::I32);
  std::vector<StepResult> out(static_cast<size_t>(kSteps));
  const KernelContext ctx;
  for (int step = 0; step < kSteps; ++step) {
    std::memset(grads.base(), 0, grads.used());
    for (int mb = 0; mb < m; ++mb) {
      fill(step, mb, tk, tg);
      chunk.forward(ctx, 0, tk, tg, kDloss);
      chunk.backward(ctx, 0, tk, mb == m - 1 ? GradPhase::Final : GradPhase::Accumulate, Tensor(), BackwardPart::Full);
    }
    out[size_t(step)].loss = chunk.take_loss(ctx);
    for (const Parameter& prm : chunk.parameters()) {
      const double* g = prm.grad.data<double>();
      out[size_t(step)].grads[prm.name].assign(g, g + prm.grad.numel());
    }
  }
  return out;
}

class PipelineSchedules : public testing::TestWithParam<PipeCase> {};

TEST_P(PipelineSchedules, RunsTheListInOrderOnTheRightData) {
  const PipeCase& c = GetParam();
  Pipeline pipe(c.kind, c.p, c.m, c.v);
  pipe.run();
  for (int r = 0; r < c.p; ++r) {
    auto& R = pipe.rank(r);
    EXPECT_TRUE(R.trace.problems.empty()) << "rank " << r << ": " << testing::PrintToString(R.trace.problems);
    for (auto& ch : R.chunks) EXPECT_EQ(ch->pending_weight_parts(), 0u) << "rank " << r;
    // Only the last microbatch's backward makes the gradients final: each
    // layer's gradient-ready hook fires once a step.
    size_t layers = 0;
    for (const ChunkCall& call : R.trace.calls) {
      if (call.kind == ChunkCall::Forward) continue;
      EXPECT_EQ(call.phase == GradPhase::Final, call.microbatch == c.m - 1)
          << "rank " << r << ": " << chunk_call_name(call.kind) << " of microbatch " << call.microbatch;
    }
    for (auto& ch : R.chunks)
      layers += size_t(ch->placement().end_layer - ch->placement().first_layer + ch->placement().has_embedding +
                       ch->placement().has_head);
    EXPECT_EQ(R.trace.hooks.size(), kSteps * layers) << "rank " << r;
    const std::vector<std::string> want = pipe.expected(r);
    for (int step = 0; step < kSteps; ++step) {
      std::vector<std::string> got;
      for (size_t i = R.step_begins[size_t(step)]; i < R.step_begins[size_t(step) + 1]; ++i) {
        const Event& e = R.events[i];
        if (e.kind == Event::Call || e.kind == Event::WaitRecv || e.kind == Event::PostSend) got.push_back(e.what);
      }
      EXPECT_EQ(got, want) << "rank " << r << ", step " << step;
    }
  }
  EXPECT_TRUE(pipe.world().changed_in_flight().empty()) << testing::PrintToString(pipe.world().changed_in_flight());
}

// Receives are posted in list order and waited for in the same order; at
// most kLookahead are outstanding, and when one is waited for, the next
// (if the list has one) is already posted.
TEST_P(PipelineSchedules, PostsReceivesAheadByTheLookahead) {
  const PipeCase& c = GetParam();
  Pipeline pipe(c.kind, c.p, c.m, c.v);
  pipe.run();
  for (int r = 0; r < c.p; ++r) {
    auto& R = pipe.rank(r);
    int receives = 0;
    for (const PipeInstr& in : R.list)
      receives += (in.op == PipeOp::RecvActivation || in.op == PipeOp::RecvGradient) && !pipe.local(r, in);
    for (int step = 0; step < kSteps; ++step) {
      std::vector<int64_t> posted;
      size_t waited = 0;
      int most = 0;
      for (size_t i = R.step_begins[size_t(step)]; i < R.step_begins[size_t(step) + 1]; ++i) {
        const Event& e = R.events[i];
        if (e.kind == Event::PostRecv) posted.push_back(e.id);
        if (e.kind != Event::WaitRecv) {
          most = std::max(most, int(posted.size() - waited));
          continue;
        }
        ASSERT_LT(waited, posted.size()) << "rank " << r << " waits for a receive it has not posted";
        EXPECT_EQ(e.id, posted[waited]) << "rank " << r << ": receive " << waited << " waited out of order";
        ++waited;
        if (int(waited) < receives) {
          EXPECT_GT(posted.size(), waited) << "rank " << r << ", step " << step << ": receive " << waited
                                           << " of the list was not posted ahead of receive " << waited - 1
                                           << "'s wait";
        }
      }
      EXPECT_EQ(int(posted.size()), receives) << "rank " << r << ", step " << step;
      EXPECT_EQ(int(waited), receives) << "rank " << r << ", step " << step;
      if (receives > 0) {
        EXPECT_LE(most, kLookahead) << "rank " << r << ", step " << step;
      }
    }
  }
}

// Every send is joined within its step (the drain joins what the slots and
// buffers have not), and no pass writes a slot whose send is not joined.
TEST_P(PipelineSchedules, JoinsEverySendBeforeReuseAndAtTheDrain) {
  const PipeCase& c = GetParam();
  Pipeline pipe(c.kind, c.p, c.m, c.v);
  pipe.run();
  for (int r = 0; r < c.p; ++r) {
    auto& R = pipe.rank(r);
    for (const std::string& s : R.trace.problems) EXPECT_EQ(s.find("send"), std::string::npos) << "rank " << r << ": " << s;
    for (int step = 0; step < kSteps; ++step) {
      std::map<int64_t, int> joins;  // send id -> times joined in the step
      std::vector<int64_t> sends;
      for (size_t i = R.step_begins[size_t(step)]; i < R.step_begins[size_t(step) + 1]; ++i) {
        const Event& e = R.events[i];
        if (e.kind == Event::PostSend) sends.push_back(e.id);
        if (e.kind == Event::JoinSend) ++joins[e.id];
      }
      for (int64_t id : sends) EXPECT_EQ(joins[id], 1) << "rank " << r << ", step " << step << ": send " << id;
      EXPECT_EQ(joins.size(), sends.size()) << "rank " << r << ", step " << step << ": a join of another step's send";
    }
  }
}

// Passes in Forward or Backward, feeds in DataWait, receive waits in
// PpBubble, send joins in PpCommExposed.
TEST_P(PipelineSchedules, ChargesEachWaitAndPassToItsPart) {
  const PipeCase& c = GetParam();
  Pipeline pipe(c.kind, c.p, c.m, c.v);
  pipe.run();
  for (int r = 0; r < c.p; ++r) {
    auto& R = pipe.rank(r);
    int feeds = 0, joins = 0;
    for (const Event& e : R.events) {
      std::optional<StepPart> want;
      switch (e.kind) {
        case Event::Call: want = e.what[0] == 'F' ? StepPart::Forward : StepPart::Backward; break;
        case Event::Feed: want = StepPart::DataWait, ++feeds; break;
        case Event::WaitRecv: want = StepPart::PpBubble; break;
        case Event::JoinSend: want = StepPart::PpCommExposed, ++joins; break;
        default: continue;
      }
      EXPECT_EQ(part_name(e.part), part_name(want)) << "rank " << r << ": " << e.what;
    }
    EXPECT_GT(joins, 0) << "rank " << r;
    EXPECT_EQ(feeds > 0, pipe.feeds(r)) << "rank " << r;
  }
}

TEST_P(PipelineSchedules, LossesAndGradientsEqualOneRank) {
  const PipeCase& c = GetParam();
  Pipeline pipe(c.kind, c.p, c.m, c.v);
  pipe.run();
  const std::vector<StepResult> ref = reference(c.p, c.m, c.v);
  for (int step = 0; step < kSteps; ++step) {
    double loss = 0;
    std::map<std::string, std::vector<double>> grads;
    for (int r = 0; r < c.p; ++r) {
      const StepResult& s = pipe.results()[size_t(step)][size_t(r)];
      loss += s.loss;  // only the head's chunk has a loss
      for (const auto& [name, g] : s.grads) EXPECT_TRUE(grads.emplace(name, g).second) << name << " on two ranks";
    }
    EXPECT_EQ(loss, ref[size_t(step)].loss) << "step " << step;
    EXPECT_NE(loss, 0.0);
    ASSERT_EQ(grads.size(), ref[size_t(step)].grads.size());
    for (const auto& [name, g] : ref[size_t(step)].grads) {
      EXPECT_EQ(grads[name], g) << name << ", step " << step;
      EXPECT_NE(g, std::vector<double>(g.size(), 0.0)) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Step, PipelineSchedules,
                         testing::Values(PipeCase{ScheduleKind::GPipe, 2, 4, 1}, PipeCase{ScheduleKind::GPipe, 3, 3, 1},
                                         PipeCase{ScheduleKind::OneFOneB, 2, 6, 1},
                                         PipeCase{ScheduleKind::OneFOneB, 4, 8, 1},
                                         PipeCase{ScheduleKind::Interleaved, 2, 4, 2},
                                         PipeCase{ScheduleKind::Interleaved, 3, 6, 2},
                                         PipeCase{ScheduleKind::ZeroBubbleH1, 2, 6, 1},
                                         PipeCase{ScheduleKind::ZeroBubbleH1, 4, 8, 1},
                                         PipeCase{ScheduleKind::ZeroBubbleH2, 2, 6, 1},
                                         PipeCase{ScheduleKind::ZeroBubbleH2, 4, 8, 1},
                                         PipeCase{ScheduleKind::ZeroBubbleV, 2, 6, 2},
                                         PipeCase{ScheduleKind::ZeroBubbleV, 3, 5, 2},
                                         PipeCase{ScheduleKind::ZeroBubbleV, 4, 8, 2}),
                         case_name);

// zb_h1 and zb_h2 split each backward and defer the weight parts; their
// losses and gradients are 1F1B's bitwise (m = 2p: zb_h2's whole warm-up).
TEST(PipelineZeroBubble, EqualsOneFOneB) {
  for (ScheduleKind kind : {ScheduleKind::ZeroBubbleH1, ScheduleKind::ZeroBubbleH2})
  for (int p : {2, 3, 4}) {
    SCOPED_TRACE(schedule_name(kind));
    Pipeline zb(kind, p, 2 * p, 1), ofob(ScheduleKind::OneFOneB, p, 2 * p, 1);
    zb.run();
    ofob.run();
    for (int step = 0; step < kSteps; ++step)
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(zb.results()[size_t(step)][size_t(r)].loss, ofob.results()[size_t(step)][size_t(r)].loss) << "p " << p;
        EXPECT_EQ(zb.results()[size_t(step)][size_t(r)].grads, ofob.results()[size_t(step)][size_t(r)].grads)
            << "p " << p << ", rank " << r;
      }
  }
}

}  // namespace
}  // namespace xirang
