#include "runtime/step/schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <tuple>

#include "core/error.h"
#include "runtime/config/schedule_rules.h"
#include "runtime/step/schedule_zbv.h"

namespace xirang {

const char* pipe_op_name(PipeOp op) {
  switch (op) {
    case PipeOp::RecvActivation: return "recv_act";
    case PipeOp::Forward: return "forward";
    case PipeOp::SendActivation: return "send_act";
    case PipeOp::RecvGradient: return "recv_grad";
    case PipeOp::Backward: return "backward";
    case PipeOp::SendGradient: return "send_grad";
    case PipeOp::BackwardInput: return "backward_input";
    case PipeOp::BackwardWeight: return "backward_weight";
    case PipeOp::ReduceGradients: return "reduce_grads";
    case PipeOp::OptimizerStep: return "optimizer_step";
  }
  return "?";
}

namespace {

struct Compute {
  PipeOp op;  // Forward, Backward, BackwardInput or BackwardWeight
  int microbatch;
  int chunk;
};

// The compute order of one rank; communication is derived from it.
std::vector<Compute> compute_order(ScheduleKind kind, int p, int rank, int m, int v, const PassTimes& times) {
  std::vector<Compute> out;
  if (kind == ScheduleKind::ZeroBubbleV) {
    for (const PipeInstr& in : zbv_compute_order(p, rank, m, times)) out.push_back({in.op, in.microbatch, in.chunk});
    return out;
  }
  if (kind == ScheduleKind::GPipe) {
    for (int i = 0; i < m; ++i) out.push_back({PipeOp::Forward, i, 0});
    for (int i = 0; i < m; ++i) out.push_back({PipeOp::Backward, i, 0});
    return out;
  }
  if (kind == ScheduleKind::OneFOneB) {
    // Warm-up forwards fill the pipeline below this stage; then one forward
    // and one backward alternate; the cool-down drains the remaining backwards.
    const int warmup = std::min(p - rank - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) out.push_back({PipeOp::Forward, f, 0});
    while (f < m) {
      out.push_back({PipeOp::Forward, f++, 0});
      out.push_back({PipeOp::Backward, b++, 0});
    }
    while (b < m) out.push_back({PipeOp::Backward, b++, 0});
    return out;
  }
  if (kind == ScheduleKind::ZeroBubbleH1 || kind == ScheduleKind::ZeroBubbleH2) {
    // 1F1B's order of forwards and input-gradient parts after `warmup`
    // forwards; stage `rank` runs each W `lag` microbatches after its B,
    // and the last `lag` Ws fill the cool-down where 1F1B waits for
    // gradients. zb_h1 keeps 1F1B's warm-up and lags W by `rank`: every
    // stage holds p microbatches from forward to W (1F1B's peak, stage
    // 0's). zb_h2 warms up with 2 (p - rank - 1) forwards, as many as fit
    // before the first gradient comes back when F = B, and lags W by
    // 2 rank: every stage holds 2p - 1, and the idle before the first B
    // and after the last is filled with forwards and Ws (Qi et al.'s
    // parallelogram, schedule.h).
    const bool h2 = kind == ScheduleKind::ZeroBubbleH2;
    const int warmup = std::min(h2 ? 2 * (p - rank - 1) : p - rank - 1, m);
    const int lag = h2 ? 2 * rank : rank;
    int f = 0, b = 0, w = 0;
    auto input_part = [&] {
      out.push_back({PipeOp::BackwardInput, b++, 0});
      if (b - w > lag) out.push_back({PipeOp::BackwardWeight, w++, 0});
    };
    for (; f < warmup; ++f) out.push_back({PipeOp::Forward, f, 0});
    while (f < m) {
      out.push_back({PipeOp::Forward, f++, 0});
      input_part();
    }
    while (b < m) input_part();
    while (w < m) out.push_back({PipeOp::BackwardWeight, w++, 0});
    return out;
  }
  // Interleaved (Narayanan et al., 2021): virtual microbatch k runs chunk
  // (k mod p v) / p of microbatch (k / p v) p + k mod p; groups of p
  // microbatches go through chunk 0, then chunk 1, ...; backward visits the
  // chunks in reverse.
  const int total = m * v;
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto fchunk = [&](int k) { return (k % (p * v)) / p; };
  auto bchunk = [&](int k) { return v - 1 - (k % (p * v)) / p; };
  int warmup = m == p ? total : std::min(total, (p - rank - 1) * 2 + (v - 1) * p);
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({PipeOp::Forward, mb_of(f), fchunk(f)});
  while (f < total) {
    out.push_back({PipeOp::Forward, mb_of(f), fchunk(f)});
    ++f;
    out.push_back({PipeOp::Backward, mb_of(b), bchunk(b)});
    ++b;
  }
  for (; b < total; ++b) out.push_back({PipeOp::Backward, mb_of(b), bchunk(b)});
  return out;
}

}  // namespace

std::vector<PipeInstr> make_schedule(ScheduleKind kind, int p, int rank, int m, int v) {
  return make_schedule(kind, p, rank, m, v, PassTimes{});
}

std::vector<PipeInstr> make_schedule(ScheduleKind kind, int p, int rank, int m, int v, const PassTimes& times) {
  if (p < 1 || rank < 0 || rank >= p || m < 1 || v < 1)
    fail(ErrorKind::Config, "pipeline schedule: p=", p, ", rank=", rank, ", m=", m, ", v=", v, " are out of range");
  if (const std::string problem = schedule_problem(kind, p, v, m); !problem.empty()) fail(ErrorKind::Config, problem);
  const int last = p * v - 1;
  const ChunkMap map = chunk_map(kind, p, v);
  std::vector<PipeInstr> list;
  for (const Compute& c : compute_order(kind, p, rank, m, v, times)) {
    const int g = map.model_chunk(rank, c.chunk);
    if (c.op == PipeOp::Forward) {
      if (g > 0) list.push_back({PipeOp::RecvActivation, c.microbatch, c.chunk});
      list.push_back({PipeOp::Forward, c.microbatch, c.chunk});
      if (g < last) list.push_back({PipeOp::SendActivation, c.microbatch, c.chunk});
    } else if (c.op == PipeOp::BackwardWeight) {
      list.push_back({PipeOp::BackwardWeight, c.microbatch, c.chunk});  // local: nothing to receive or send
    } else {
      if (g < last) list.push_back({PipeOp::RecvGradient, c.microbatch, c.chunk});
      list.push_back({c.op, c.microbatch, c.chunk});
      if (g > 0) list.push_back({PipeOp::SendGradient, c.microbatch, c.chunk});
    }
  }
  list.push_back({PipeOp::ReduceGradients, -1, -1});
  list.push_back({PipeOp::OptimizerStep, -1, -1});
  return list;
}

int max_in_flight(const std::vector<PipeInstr>& list, int v) {
  std::vector<int> live(size_t(v), 0);
  int peak = 0;
  for (const PipeInstr& in : list) {
    if (in.op == PipeOp::Forward) peak = std::max(peak, ++live[size_t(in.chunk)]);
    if (in.op == PipeOp::Backward || in.op == PipeOp::BackwardWeight) --live[size_t(in.chunk)];
  }
  return peak;
}

SlotCounts slot_counts(const std::vector<PipeInstr>& list, int v, int receives_ahead) {
  std::vector<int> act(size_t(v), 0), in(size_t(v), 0), w(size_t(v), 0);
  SlotCounts peak;
  bool split = false;
  for (const PipeInstr& i : list) {
    if (i.chunk < 0) continue;
    const size_t c = size_t(i.chunk);
    switch (i.op) {
      case PipeOp::Forward:
        peak.activation = std::max(peak.activation, ++act[c]);
        peak.input = std::max(peak.input, ++in[c]);
        break;
      case PipeOp::Backward:
        --act[c];
        --in[c];
        break;
      case PipeOp::BackwardInput:
        split = true;
        --act[c];
        peak.weight = std::max(peak.weight, ++w[c]);
        break;
      case PipeOp::BackwardWeight:
        --in[c];
        --w[c];
        break;
      default: break;
    }
  }
  peak.activation += receives_ahead;
  if (!split) peak.input = peak.weight = 0;
  return peak;
}

double analytic_bubble(ScheduleKind kind, int p, int m, int v) {
  if (kind == ScheduleKind::Interleaved) return double(p - 1) / (double(v) * m + p - 1);
  // zb_h2 with the step's flush idles (p - 1) F as zb_h1 does at F = B = W (bubble_time).
  if (kind == ScheduleKind::ZeroBubbleH1 || kind == ScheduleKind::ZeroBubbleH2) return double(p - 1) / (3.0 * m + p - 1);
  // zb_v at F = B = W, m >= 2p: (p - 1) F / 2 idle beside 3 m F busy (schedule_zbv.h).
  if (kind == ScheduleKind::ZeroBubbleV) return double(p - 1) / (6.0 * m + p - 1);
  return double(p - 1) / double(m + p - 1);
}

double bubble_time(ScheduleKind kind, int p, double f, double b, double w) {
  if (kind == ScheduleKind::ZeroBubbleH1) return (p - 1) * (f + b - std::min(w, f));
  if (kind == ScheduleKind::ZeroBubbleH2) {
    XR_CHECK(w <= f && 2 * w <= f + b, "bubble_time: zb_h2's closed form needs W <= F and 2W <= F + B (got F=", f,
             ", B=", b, ", W=", w, ")");
    return (p - 1) * (f + b - 2 * w);
  }
  XR_CHECK(kind == ScheduleKind::OneFOneB || kind == ScheduleKind::GPipe, "bubble_time: ", schedule_name(kind),
           " has no closed form here");
  return (p - 1) * (f + b + w);
}

namespace {

// One simulated step: every rank runs its list in order; a send posts a
// message that arrives `transfer` later, a receive blocks until it has.
class Simulation {
 public:
  Simulation(ScheduleKind kind, int p, int m, int v, const SimCosts& costs)
      : kind_(kind), map_(chunk_map(kind, p, v)), p_(p), m_(m), v_(v), costs_(costs) {
    // zb_v's list is found at the costs it runs at (its scalar ones: per-rank costs do not move it).
    const PassTimes times{costs.forward / v, costs.backward * (1 - costs.weight_share) / v,
                          costs.backward * costs.weight_share / v};
    for (int rank = 0; rank < p; ++rank) lists_.push_back(make_schedule(kind, p, rank, m, v, times));
    pc_.assign(size_t(p), 0);
    clock_.assign(size_t(p), 0);
    live_.assign(size_t(p), 0);
    first_start_.assign(size_t(p), -1);
    r_.busy.assign(size_t(p), 0);
    r_.peak_in_flight.assign(size_t(p), 0);
    XR_CHECK(costs.forward_per_rank.empty() || int(costs.forward_per_rank.size()) == p, "forward_per_rank needs ",
             p, " entries");
    XR_CHECK(costs.backward_per_rank.empty() || int(costs.backward_per_rank.size()) == p,
             "backward_per_rank needs ", p, " entries");
  }

  // Sweeps over the ranks until every list has run, none can move (a
  // deadlock), or an instruction breaks a dependency.
  SimResult run() {
    for (;;) {
      bool progress = false, all_done = true;
      for (int rank = 0; rank < p_; ++rank) {
        const int ran = run_rank(rank);
        if (ran < 0) return r_;
        progress = progress || ran > 0;
        if (!finished(rank)) all_done = false;
      }
      if (all_done) break;
      if (!progress) return failed(deadlock_report());
    }
    return complete();
  }

 private:
  enum class Exec { Done, Blocked, Failed };
  // A message in flight: (0 activation or 1 gradient, microbatch, destination model chunk).
  using MailKey = std::tuple<int, int, int>;

  bool finished(int rank) const { return pc_[size_t(rank)] >= lists_[size_t(rank)].size(); }

  // Runs rank's instructions until one blocks or the list ends; returns how
  // many ran, or -1 when one failed (r_ then says why).
  int run_rank(int rank) {
    int ran = 0;
    for (; !finished(rank); ++pc_[size_t(rank)], ++ran) {
      const Exec e = execute(rank, lists_[size_t(rank)][pc_[size_t(rank)]]);
      if (e == Exec::Blocked) break;
      if (e == Exec::Failed) return -1;
    }
    return ran;
  }

  Exec execute(int rank, const PipeInstr& in) {
    const int g = in.chunk >= 0 ? map_.model_chunk(rank, in.chunk) : -1;
    double& t = clock_[size_t(rank)];
    if (in.op == PipeOp::RecvActivation || in.op == PipeOp::RecvGradient) {
      auto it = mail_.find(MailKey{in.op == PipeOp::RecvActivation ? 0 : 1, in.microbatch, g});
      if (it == mail_.end()) return Exec::Blocked;  // until the peer sends
      t = std::max(t, it->second);
      mail_.erase(it);
    } else if (in.op == PipeOp::SendActivation) {
      if (!mail_.emplace(MailKey{0, in.microbatch, g + 1}, t + costs_.transfer).second)
        return broke("activation of microbatch " + std::to_string(in.microbatch) + " sent twice");
    } else if (in.op == PipeOp::SendGradient) {
      if (!mail_.emplace(MailKey{1, in.microbatch, g - 1}, t + costs_.transfer).second)
        return broke("gradient of microbatch " + std::to_string(in.microbatch) + " sent twice");
    } else if (in.op == PipeOp::Forward) {
      compute(rank, forward_cost(rank));
      forwarded_.insert({g, in.microbatch});
      r_.peak_in_flight[size_t(rank)] = std::max(r_.peak_in_flight[size_t(rank)], ++live_[size_t(rank)]);
    } else if (in.op == PipeOp::Backward || in.op == PipeOp::BackwardInput) {
      if (!forwarded_.count({g, in.microbatch}))
        return broke("backward of microbatch " + std::to_string(in.microbatch) + " on model chunk " +
                     std::to_string(g) + " before its forward");
      if (in.op == PipeOp::Backward) {
        compute(rank, backward_cost(rank));
        --live_[size_t(rank)];
      } else {
        compute(rank, backward_cost(rank) * (1 - costs_.weight_share));
        input_done_.insert({g, in.microbatch});
      }
    } else if (in.op == PipeOp::BackwardWeight) {
      if (!input_done_.erase({g, in.microbatch}))
        return broke("weight gradients of microbatch " + std::to_string(in.microbatch) + " on model chunk " +
                     std::to_string(g) + " before its input gradient (or twice)");
      compute(rank, backward_cost(rank) * costs_.weight_share);
      --live_[size_t(rank)];
    }
    return Exec::Done;
  }

  // A local chunk costs 1/v of the rank's stage.
  double forward_cost(int rank) const {
    return (costs_.forward_per_rank.empty() ? costs_.forward : costs_.forward_per_rank[size_t(rank)]) / v_;
  }
  double backward_cost(int rank) const {
    return (costs_.backward_per_rank.empty() ? costs_.backward : costs_.backward_per_rank[size_t(rank)]) / v_;
  }
  void compute(int rank, double cost) {
    if (first_start_[size_t(rank)] < 0) first_start_[size_t(rank)] = clock_[size_t(rank)];
    clock_[size_t(rank)] += cost;
    r_.busy[size_t(rank)] += cost;
  }

  std::string deadlock_report() const {
    std::string e = "deadlock:";
    for (int rank = 0; rank < p_; ++rank) {
      if (finished(rank)) continue;
      const PipeInstr& in = lists_[size_t(rank)][pc_[size_t(rank)]];
      e += " rank " + std::to_string(rank) + " waits at " + pipe_op_name(in.op) + "(mb " +
           std::to_string(in.microbatch) + ", chunk " + std::to_string(in.chunk) + ");";
    }
    return e;
  }

  // After every list ran: no message left over, every forward ran; then the timings.
  SimResult complete() {
    if (!mail_.empty()) return failed(std::to_string(mail_.size()) + " message(s) were sent but never received");
    if (!input_done_.empty())
      return failed(std::to_string(input_done_.size()) + " input-gradient part(s) never had their weight part");
    for (int g = 0; g < p_ * v_; ++g)
      for (int mb = 0; mb < m_; ++mb)
        if (!forwarded_.count({g, mb}))
          return failed("microbatch " + std::to_string(mb) + " never ran forward on model chunk " + std::to_string(g));
    r_.makespan = *std::max_element(clock_.begin(), clock_.end());
    double idle = 0;
    for (int rank = 0; rank < p_; ++rank) idle += (r_.makespan - r_.busy[size_t(rank)]) / r_.makespan;
    r_.bubble_fraction = idle / p_;
    r_.span.assign(size_t(p_), 0);
    for (int rank = 0; rank < p_; ++rank)
      r_.span[size_t(rank)] = first_start_[size_t(rank)] < 0 ? 0 : clock_[size_t(rank)] - first_start_[size_t(rank)];
    r_.ok = true;
    return r_;
  }

  Exec broke(const std::string& error) {
    failed(error);
    return Exec::Failed;
  }
  SimResult failed(const std::string& error) {
    r_.ok = false;
    r_.error = error;
    return r_;
  }

  const ScheduleKind kind_;
  const ChunkMap map_;
  const int p_, m_, v_;
  const SimCosts& costs_;
  std::vector<std::vector<PipeInstr>> lists_;  // (p): each rank's list
  std::vector<size_t> pc_;                     // (p): each rank's next instruction
  std::vector<double> clock_;                  // (p): each rank's time
  std::vector<double> first_start_;            // (p): when each rank's first compute began (-1: none yet)
  std::vector<int> live_;                      // (p): microbatch-chunks with live activations
  std::map<MailKey, double> mail_;             // message -> arrival time
  std::set<std::pair<int, int>> forwarded_;    // (model chunk, microbatch) whose forward ran
  std::set<std::pair<int, int>> input_done_;   // (model chunk, microbatch) whose B ran and W has not
  SimResult r_;
};

}  // namespace

SimResult simulate(ScheduleKind kind, int p, int m, int v, const SimCosts& costs) {
  return Simulation(kind, p, m, v, costs).run();
}

}  // namespace xirang
