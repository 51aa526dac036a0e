#include "analysis/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "models/model.h"
#include "runtime/config/model_layout.h"
#include "runtime/config/schedule_rules.h"
#include "runtime/memory_estimate.h"
#include "runtime/step/schedule.h"
#include "analysis/plan/collectives.h"
#include "analysis/plan/stage_cost.h"

namespace xirang::analysis::plan {

namespace {

// Element-wise traffic of one transformer layer's forward, in multiples of
// (tokens x d_model x element size): LayerNorms, residual adds and dropout
// outside the tensor-parallel regions (split only under sequence
// parallelism), and GELU, bias adds and attention's reshapes inside them.
constexpr double kElemOutside = 10, kElemInside = 16;
// Bytes per logit the loss reads and writes (fp32 logits, softmax, gradient).
constexpr double kLossBytesPerLogit = 12;
// Element-wise traffic of the MLP's activation, in multiples of (tokens x
// MLP width x element size): SwiGLU reads gate and up and writes their
// product; GELU reads one and writes one.
constexpr double kActivationTraffic = 3;
// With tp_comm_overlap, the share of the collectives hidden behind the GEMMs (when they are long enough).
constexpr double kTpOverlapHidden = 0.8;

double dtype_bytes(const Config& c) { return c.precision.dtype == Precision::FP32 ? 4 : 2; }
bool is_fp32(const Config& c) { return c.precision.dtype == Precision::FP32; }

double exposed_tp(double comm, double gemm, const Features& f) {
  if (!f.tp_comm_overlap) return comm;
  return std::max(comm * (1 - kTpOverlapHidden), comm - gemm);
}

// Forward of one transformer layer for one microbatch. A cp rank holds T /
// cp rows of each sequence: every per-token cost divides by cp, the
// attention core's too (its queries see all T keys, and the head-tail split
// gives each rank as many causal scores).
PassCost layer_forward(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f) {
  const Config& cfg = w.cfg;
  const double n = rank_tokens(w, l), h = cfg.model.d_model, ds = dtype_bytes(cfg);
  const double gemm = c.matmul_seconds(n * w.layer_flops_per_token / 3 / l.tp, h, is_fp32(cfg));
  const double elem = c.memory_seconds(n * h * ds * (kElemOutside / (l.sequence_parallel ? l.tp : 1) + kElemInside / l.tp));
  PassCost p;
  p.compute = gemm + elem + c.op_overhead_us * 1e-6;
  // Two collectives of the (tokens x d_model) activations: all-reduces, or
  // all-gather + reduce-scatter pairs under sequence parallelism (the same bytes).
  if (l.tp > 1) p.tp_comm = exposed_tp(2 * all_reduce_s(n * h * ds, l.tp, c.intra_node), gemm, f);
  p.cp_comm = cp_gather_s(w, l, c);
  return p;
}

// What selective recomputation runs again in one layer's backward, one
// microbatch: the attention core's forward (its products at the rate the
// layer's forward gives them, so that the core costs what it costs there)
// and the MLP's activation (element-wise: its input read, its output
// written). No tensor-parallel collectives: both lie inside the region; under
// cp the core gathers the keys and values once more.
PassCost layer_selective(const Workload& w, const PlanLayout& l, const Cluster& c) {
  const Config& cfg = w.cfg;
  const double n = rank_tokens(w, l), ds = dtype_bytes(cfg);
  PassCost p;
  p.compute = c.matmul_seconds(n * w.attention_flops_per_token / l.tp, cfg.model.d_model, is_fp32(cfg)) +
              c.memory_seconds(n * w.ffn_width / l.tp * ds * kActivationTraffic) + c.op_overhead_us * 1e-6;
  p.cp_comm = cp_gather_s(w, l, c);
  return p;
}

// Embedding (first chunk) or head and loss (last chunk), forward.
PassCost ends_forward(const Workload& w, const PlanLayout& l, const Cluster& c, bool first, bool last) {
  const Config& cfg = w.cfg;
  const double n = rank_tokens(w, l), h = cfg.model.d_model, ds = dtype_bytes(cfg);
  PassCost p;
  if (first) {
    p.compute += c.memory_seconds(3 * n * h * ds);
    if (l.tp > 1) p.tp_comm += all_reduce_s(n * h * ds, l.tp, c.intra_node);  // vocabulary-parallel lookup
  }
  if (last) {
    const double V = cfg.model.padded_vocab();
    p.compute += c.matmul_seconds(n * w.head_flops_per_token / 3 / l.tp, h, is_fp32(cfg)) +
                 c.memory_seconds(n * V / l.tp * kLossBytesPerLogit) + c.op_overhead_us * 1e-6;
  }
  return p;
}

}  // namespace

double rank_tokens(const Workload& w, const PlanLayout& l) {
  return double(l.micro_batch) * w.cfg.seq_len() / l.cp;
}

// Every rank's keys and values of one layer, one microbatch (models/layers/cp_comm.h):
// B sequences x T rows x (k and v) x the kv heads of this tp rank x head_dim, in the activations' dtype.
double cp_kv_bytes(const Workload& w, const PlanLayout& l) {
  const ModelDims& d = w.cfg.model;
  return double(l.micro_batch) * w.cfg.seq_len() * 2 * (double(d.kv_heads()) / l.tp) * d.head_size() * dtype_bytes(w.cfg);
}

const Link& cp_link(const Cluster& c, const PlanLayout& l) { return link_for(c, l.tp, l.cp); }

double cp_gather_s(const Workload& w, const PlanLayout& l, const Cluster& c) {
  return all_gather_s(cp_kv_bytes(w, l), l.cp, cp_link(c, l));
}

double cp_reduce_scatter_s(const Workload& w, const PlanLayout& l, const Cluster& c) {
  return reduce_scatter_s(cp_kv_bytes(w, l), l.cp, cp_link(c, l));
}

// Per-microbatch costs of pipeline rank r (all its chunks).
StageCost stage_cost(const Workload& w, const PlanLayout& l, const Cluster& c, const Features& f, int r) {
  const int chunks = l.pp * l.virtual_stages, layers = w.cfg.model.n_layer / chunks;
  const PassCost lf = layer_forward(w, l, c, f);
  StageCost s;
  for (int k = 0; k < l.virtual_stages; ++k) {
    const int g = k * l.pp + r;
    const PassCost e = ends_forward(w, l, c, g == 0, g == chunks - 1);
    s.fwd.compute += layers * lf.compute + e.compute;
    s.fwd.tp_comm += layers * lf.tp_comm + e.tp_comm;
    s.fwd.cp_comm += layers * lf.cp_comm;
    // Backward: twice the forward's work (backward_factor of its time), the mirrored collectives;
    // under cp the keys and values gathered again and their gradients reduce-scattered to their owners.
    s.bwd.compute += c.backward_factor * (layers * lf.compute + e.compute);
    s.bwd.tp_comm += layers * lf.tp_comm + e.tp_comm;
    s.bwd.cp_comm += layers * (cp_gather_s(w, l, c) + cp_reduce_scatter_s(w, l, c));
    if (l.recompute == Recompute::Full) {
      s.rc.compute += layers * lf.compute;
      s.rc.tp_comm += layers * lf.tp_comm;
      s.rc.cp_comm += layers * lf.cp_comm;
    } else if (l.recompute == Recompute::Selective) {
      const PassCost sel = layer_selective(w, l, c);
      s.rc.compute += layers * sel.compute;
      s.rc.cp_comm += layers * sel.cp_comm;
    }
  }
  return s;
}

// Whether a group whose members are `stride` ranks apart, `size` of them, leaves a node.
const Link& link_for(const Cluster& c, int stride, int size) {
  return stride * size > c.devices_per_node ? c.inter_node : c.intra_node;
}

const Link& link_between_stages(const Cluster& c, const PlanLayout& l) { return link_for(c, l.tp * l.cp * l.dp, 2); }

double local_params(const Workload& w, const PlanLayout& l) {
  const double layers = double(w.cfg.model.n_layer) / l.pp;
  return (layers * w.layer_params + w.ends_params) / l.tp;
}

std::string PlanLayout::str() const {
  std::ostringstream o;
  o << "dp=" << dp << (cp > 1 ? ",cp=" + std::to_string(cp) : "") << ",tp=" << tp << ",pp=" << pp << ",virtual_stages=" << virtual_stages
    << ",micro_batch=" << micro_batch << ",zero=" << zero << ",sequence_parallel=" << int(sequence_parallel)
    << ",recompute=" << config_name(recompute);
  return o.str();
}

PlanLayout parse_layout(const std::string& text, PlanLayout l) {
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) fail(ErrorKind::Usage, "--layout: '", item, "' is not key=value");
    const std::string k = item.substr(0, eq), vs = item.substr(eq + 1);
    if (k == "recompute") {  // the config's words (train.recompute)
      const std::optional<Recompute> r = parse_config_name<Recompute>(vs);
      if (!r)
        fail(ErrorKind::Usage, "--layout: recompute=", vs, " is not one of ", config_names_text<Recompute>(),
             " (train.recompute)");
      l.recompute = *r;
      continue;
    }
    int v = 0;
    try {
      size_t used = 0;
      v = std::stoi(vs, &used);
      if (used != vs.size()) throw std::invalid_argument(vs);
    } catch (const std::exception&) {
      fail(ErrorKind::Usage, "--layout: ", k, "=", vs, " is not an integer");
    }
    if (v < 0) fail(ErrorKind::Usage, "--layout: ", k, "=", v, " must not be negative");
    if (k == "dp") l.dp = v;
    else if (k == "cp") l.cp = v;
    else if (k == "tp") l.tp = v;
    else if (k == "pp") l.pp = v;
    else if (k == "virtual_stages" || k == "v") l.virtual_stages = v;
    else if (k == "micro_batch" || k == "mb") l.micro_batch = v;
    else if (k == "zero") l.zero = v;
    else if (k == "sequence_parallel" || k == "sp") l.sequence_parallel = v != 0;
    else fail(ErrorKind::Usage, "--layout: unknown key '", k,
              "' (expected dp, cp, tp, pp, virtual_stages, micro_batch, zero, sequence_parallel, recompute)");
  }
  return l;
}

namespace {

// Training FLOPs per token of a one- and of a two-layer model of cfg's shape.
std::pair<double, double> flops_of_one_and_two_layers(const Config& cfg) {
  const ModelArch& arch = model_arch(cfg.model.arch);
  auto fpt = [&](int layers) {
    ModelDims x = cfg.model;
    x.n_layer = layers;
    auto chunk = arch.make_chunk(x, ChunkPlacement::whole(layers), DType::F32,
                                 ChunkBatch{.micro_batch = 1, .seq_len = cfg.seq_len()}, TensorParallel{});
    return chunk->flops_per_token();
  };
  return {fpt(1), fpt(2)};
}

}  // namespace

Workload workload_of(const Config& cfg) {
  Workload w;
  w.cfg = cfg;
  const ModelDims& d = cfg.model;
  const ModelArch& arch = model_arch(d.arch);
  auto count = [&](const ChunkPlacement& at) {
    double n = 0;
    for (const Parameter& prm : arch.parameters(d, at, 1, 0)) n += double(prm.value.numel());
    return n;
  };
  w.layer_params = count({0, 1, false, false});
  w.ends_params = count({0, 1, true, false}) - w.layer_params;
  const auto [f1, f2] = flops_of_one_and_two_layers(cfg);
  w.layer_flops_per_token = f2 - f1;
  w.head_flops_per_token = f1 - w.layer_flops_per_token;
  // The attention core's FLOPs per token grow with the sequence, the rest
  // do not: at twice the sequence a layer has its core's once more.
  Config twice = cfg;
  twice.train.seq_len = 2 * cfg.seq_len();
  twice.model.max_seq_len = std::max(cfg.model.max_seq_len, twice.train.seq_len);
  const auto [g1, g2] = flops_of_one_and_two_layers(twice);
  w.attention_flops_per_token = ((g2 - g1) - w.layer_flops_per_token) / 3;
  w.ffn_width = d.ffn_hidden > 0 ? d.ffn_hidden : 4.0 * d.d_model;
  return w;
}

namespace {

// The schedule a layout runs: the config's zb_v where it has its two
// chunks per rank on 2 or more; interleaved when v > 1; else the config's
// gpipe, zb_h1 or zb_h2 where pp > 1, 1F1B otherwise (one stage: no
// pipeline).
ScheduleKind layout_schedule(const Workload& w, const PlanLayout& l) {
  const ScheduleKind own = w.cfg.parallel.schedule;
  if (own == ScheduleKind::ZeroBubbleV && l.pp > 1 && l.virtual_stages == 2) return own;
  const bool keep = l.pp > 1 && (own == ScheduleKind::GPipe || own == ScheduleKind::ZeroBubbleH1 ||
                                 own == ScheduleKind::ZeroBubbleH2);
  return l.virtual_stages > 1 ? ScheduleKind::Interleaved : keep ? own : ScheduleKind::OneFOneB;
}

}  // namespace

Config layout_config(const Workload& w, const PlanLayout& l) {
  Config c = w.cfg;
  c.parallel.dp = l.dp;
  c.parallel.cp = l.cp;  // parallel.cp_split stays the config's
  c.parallel.tp = l.tp;
  c.parallel.pp = l.pp;
  c.parallel.virtual_stages = l.virtual_stages;
  c.parallel.zero = l.zero;
  c.parallel.sequence_parallel = l.sequence_parallel;
  c.parallel.schedule = layout_schedule(w, l);
  c.train.micro_batch = l.micro_batch;
  c.train.recompute = l.recompute;
  return c;
}

std::string layout_problem(const Workload& w, const PlanLayout& l, const Cluster& c) {
  if (l.dp < 1 || l.cp < 1 || l.tp < 1 || l.pp < 1 || l.virtual_stages < 1 || l.micro_batch < 1)
    return "dp, cp, tp, pp, virtual_stages and micro_batch must be at least 1";
  if (l.zero > 1) return str_cat("zero=", l.zero, ": only ZeRO-1 (zero=1) exists");
  if (l.tp > c.devices_per_node || c.devices_per_node % l.tp != 0)
    return str_cat("tp=", l.tp, " must divide the ", c.devices_per_node, " devices of a node (", c.name, ")");
  if (l.sequence_parallel && l.tp == 1) return "sequence_parallel needs tp > 1";
  const int gb = w.cfg.train.global_batch;
  if (gb % (l.micro_batch * l.dp) != 0)
    return str_cat("train.global_batch=", gb, " is not divisible by micro_batch x dp = ", l.micro_batch * l.dp);
  const std::string model = xirang::layout_problem(w.cfg.model, ParallelLayout{l.dp, l.tp, l.pp, l.virtual_stages});
  if (!model.empty()) return model;
  // Sequences over cp (2 cp chunks each), token rows over tp: the config's rules, in its words.
  const std::string sharding = sharding_problem(layout_config(w, l));
  if (!sharding.empty()) return sharding;
  const int m = gb / (l.micro_batch * l.dp);
  // The schedule this layout runs, under the rules validation and make_schedule apply.
  const std::string schedule = schedule_problem(layout_schedule(w, l), l.pp, l.virtual_stages, m);
  if (!schedule.empty()) return schedule;
  if (c.nodes > 0 && l.devices() > c.nodes * c.devices_per_node)
    return str_cat(l.devices(), " devices is more than the cluster's ", c.nodes * c.devices_per_node);
  return "";
}

}  // namespace xirang::analysis::plan
