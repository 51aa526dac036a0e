#include "runtime/schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "core/error.h"

namespace xirang {

const char* pipe_op_name(PipeOp op) {
  switch (op) {
    case PipeOp::RecvActivation: return "recv_act";
    case PipeOp::Forward: return "forward";
    case PipeOp::SendActivation: return "send_act";
    case PipeOp::RecvGradient: return "recv_grad";
    case PipeOp::Backward: return "backward";
    case PipeOp::SendGradient: return "send_grad";
    case PipeOp::ReduceGradients: return "reduce_grads";
    case PipeOp::OptimizerStep: return "optimizer_step";
  }
  return "?";
}

namespace {

struct Compute {
  bool forward;
  int microbatch;
  int chunk;
};

// The compute order of one rank; communication is derived from it.
std::vector<Compute> compute_order(ScheduleKind kind, int p, int rank, int m, int v) {
  std::vector<Compute> out;
  if (kind == ScheduleKind::GPipe) {
    for (int i = 0; i < m; ++i) out.push_back({true, i, 0});
    for (int i = 0; i < m; ++i) out.push_back({false, i, 0});
    return out;
  }
  if (kind == ScheduleKind::OneFOneB) {
    // Warm-up forwards fill the pipeline below this stage; then one forward
    // and one backward alternate; the cool-down drains the remaining backwards.
    const int warmup = std::min(p - rank - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) out.push_back({true, f, 0});
    while (f < m) {
      out.push_back({true, f++, 0});
      out.push_back({false, b++, 0});
    }
    while (b < m) out.push_back({false, b++, 0});
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
  for (; f < warmup; ++f) out.push_back({true, mb_of(f), fchunk(f)});
  while (f < total) {
    out.push_back({true, mb_of(f), fchunk(f)});
    ++f;
    out.push_back({false, mb_of(b), bchunk(b)});
    ++b;
  }
  for (; b < total; ++b) out.push_back({false, mb_of(b), bchunk(b)});
  return out;
}

}  // namespace

std::vector<PipeInstr> make_schedule(ScheduleKind kind, int p, int rank, int m, int v) {
  if (p < 1 || rank < 0 || rank >= p || m < 1 || v < 1)
    fail(ErrorKind::Config, "pipeline schedule: p=", p, ", rank=", rank, ", m=", m, ", v=", v, " are out of range");
  if (kind == ScheduleKind::Interleaved) {
    if (v < 2) fail(ErrorKind::Config, "parallel.schedule=interleaved needs parallel.virtual_stages >= 2 (got ", v, ")");
    if (m % p != 0)
      fail(ErrorKind::Config, "parallel.schedule=interleaved needs the microbatches per step (", m,
           ") to be a multiple of parallel.pp (", p, ")");
  } else if (v != 1) {
    fail(ErrorKind::Config, "parallel.schedule=", schedule_name(kind), " runs one stage per rank: parallel.virtual_stages=",
         v, " needs parallel.schedule=interleaved");
  }
  const int last = p * v - 1;
  std::vector<PipeInstr> list;
  for (const Compute& c : compute_order(kind, p, rank, m, v)) {
    const int g = model_chunk(p, rank, c.chunk);
    if (c.forward) {
      if (g > 0) list.push_back({PipeOp::RecvActivation, c.microbatch, c.chunk});
      list.push_back({PipeOp::Forward, c.microbatch, c.chunk});
      if (g < last) list.push_back({PipeOp::SendActivation, c.microbatch, c.chunk});
    } else {
      if (g < last) list.push_back({PipeOp::RecvGradient, c.microbatch, c.chunk});
      list.push_back({PipeOp::Backward, c.microbatch, c.chunk});
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
    if (in.op == PipeOp::Backward) --live[size_t(in.chunk)];
  }
  return peak;
}

double analytic_bubble(ScheduleKind kind, int p, int m, int v) {
  if (kind == ScheduleKind::Interleaved) return double(p - 1) / (double(v) * m + p - 1);
  return double(p - 1) / double(m + p - 1);
}

SimResult simulate(ScheduleKind kind, int p, int m, int v, const SimCosts& costs) {
  SimResult r;
  std::vector<std::vector<PipeInstr>> lists;
  for (int rank = 0; rank < p; ++rank) lists.push_back(make_schedule(kind, p, rank, m, v));
  const int last = p * v - 1;
  // Messages in flight: (direction, microbatch, destination model chunk) -> arrival time.
  using Key = std::tuple<int, int, int>;
  std::map<Key, double> mail;
  std::vector<size_t> pc(size_t(p), 0);
  std::vector<double> clock(size_t(p), 0);
  r.busy.assign(size_t(p), 0);
  r.peak_in_flight.assign(size_t(p), 0);
  std::vector<int> live(size_t(p), 0);
  std::map<std::tuple<int, int>, int> forwarded;  // (model chunk, microbatch) -> 1 once forward ran
  XR_CHECK(costs.forward_per_rank.empty() || int(costs.forward_per_rank.size()) == p, "forward_per_rank needs ", p,
           " entries");
  XR_CHECK(costs.backward_per_rank.empty() || int(costs.backward_per_rank.size()) == p, "backward_per_rank needs ",
           p, " entries");
  auto fcost_of = [&](int rank) {
    return (costs.forward_per_rank.empty() ? costs.forward : costs.forward_per_rank[size_t(rank)]) / v;
  };
  auto bcost_of = [&](int rank) {
    return (costs.backward_per_rank.empty() ? costs.backward : costs.backward_per_rank[size_t(rank)]) / v;
  };
  auto fail_sim = [&](const std::string& e) {
    r.ok = false;
    r.error = e;
    return r;
  };
  for (;;) {
    bool progress = false, all_done = true;
    for (int rank = 0; rank < p; ++rank) {
      auto& list = lists[size_t(rank)];
      while (pc[size_t(rank)] < list.size()) {
        const PipeInstr& in = list[size_t(pc[size_t(rank)])];
        const int g = in.chunk >= 0 ? model_chunk(p, rank, in.chunk) : -1;
        double& t = clock[size_t(rank)];
        if (in.op == PipeOp::RecvActivation || in.op == PipeOp::RecvGradient) {
          const Key k{in.op == PipeOp::RecvActivation ? 0 : 1, in.microbatch, g};
          auto it = mail.find(k);
          if (it == mail.end()) break;  // blocked until the peer sends
          t = std::max(t, it->second);
          mail.erase(it);
        } else if (in.op == PipeOp::SendActivation) {
          if (!mail.emplace(Key{0, in.microbatch, g + 1}, t + costs.transfer).second)
            return fail_sim("activation of microbatch " + std::to_string(in.microbatch) + " sent twice");
        } else if (in.op == PipeOp::SendGradient) {
          if (!mail.emplace(Key{1, in.microbatch, g - 1}, t + costs.transfer).second)
            return fail_sim("gradient of microbatch " + std::to_string(in.microbatch) + " sent twice");
        } else if (in.op == PipeOp::Forward) {
          const double fcost = fcost_of(rank);
          t += fcost;
          r.busy[size_t(rank)] += fcost;
          forwarded[{g, in.microbatch}] = 1;
          r.peak_in_flight[size_t(rank)] = std::max(r.peak_in_flight[size_t(rank)], ++live[size_t(rank)]);
        } else if (in.op == PipeOp::Backward) {
          if (!forwarded.count({g, in.microbatch}))
            return fail_sim("backward of microbatch " + std::to_string(in.microbatch) + " on model chunk " +
                            std::to_string(g) + " before its forward");
          const double bcost = bcost_of(rank);
          t += bcost;
          r.busy[size_t(rank)] += bcost;
          --live[size_t(rank)];
        }
        ++pc[size_t(rank)];
        progress = true;
      }
      if (pc[size_t(rank)] < list.size()) all_done = false;
    }
    if (all_done) break;
    if (!progress) {
      std::string e = "deadlock:";
      for (int rank = 0; rank < p; ++rank) {
        const auto& list = lists[size_t(rank)];
        if (pc[size_t(rank)] < list.size()) {
          const PipeInstr& in = list[pc[size_t(rank)]];
          e += " rank " + std::to_string(rank) + " waits at " + pipe_op_name(in.op) + "(mb " +
               std::to_string(in.microbatch) + ", chunk " + std::to_string(in.chunk) + ");";
        }
      }
      return fail_sim(e);
    }
  }
  if (!mail.empty()) return fail_sim(std::to_string(mail.size()) + " message(s) were sent but never received");
  for (int g = 0; g <= last; ++g)
    for (int mb = 0; mb < m; ++mb)
      if (!forwarded.count({g, mb}))
        return fail_sim("microbatch " + std::to_string(mb) + " never ran forward on model chunk " + std::to_string(g));
  r.makespan = *std::max_element(clock.begin(), clock.end());
  double idle = 0;
  for (int rank = 0; rank < p; ++rank) idle += (r.makespan - r.busy[size_t(rank)]) / r.makespan;
  r.bubble_fraction = idle / p;
  r.ok = true;
  return r;
}

}  // namespace xirang
