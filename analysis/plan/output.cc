#include "analysis/plan/output.h"

#include <algorithm>
#include <cstdio>

#include "analysis/format.h"

namespace xirang::analysis::plan {

namespace {

std::vector<std::pair<const char*, double>> terms(const StepTime& t) {
  return {{"forward", t.forward_s},           {"backward", t.backward_s},
          {"recompute", t.recompute_s},       {"tp_comm", t.tp_comm_s},
          {"cp_comm", t.cp_comm_s},
          {"pp_bubble", t.pp_bubble_s},       {"pp_comm_exposed", t.pp_comm_exposed_s},
          {"dp_comm_exposed", t.dp_comm_exposed_s}, {"optimizer", t.optimizer_s},
          {"data_wait", t.data_wait_s}};
}

}  // namespace

std::string table(const std::vector<Prediction>& ps, const Cluster& c) {
  std::string s = format("%-3s %-4s %-3s %-3s %-4s %-2s %-3s %-4s %-2s %-9s %9s %9s %12s %8s %6s  %s\n", "#", "dp", "cp", "tp",
                       "pp", "v", "mb", "zero", "sp", "recompute", "mem GB", "step s", "tokens/s", "TFLOP/s", "MFU",
                       "largest terms (share of step)");
  int rank = 1;
  for (const Prediction& p : ps) {
    const PlanLayout& l = p.layout;
    auto ts = terms(p.time);
    std::sort(ts.begin(), ts.end(), [](auto& a, auto& b) { return a.second > b.second; });
    std::string big;
    for (int i = 0; i < 3; ++i)
      if (ts[size_t(i)].second > 0) big += format("%s %.0f%% ", ts[size_t(i)].first, 100 * ts[size_t(i)].second / p.time.step_s);
    s += format("%-3d %-4d %-3d %-3d %-4d %-2d %-3d %-4d %-2d %-9s %9s %9.4g %12.4g %8.1f %5.1f%%  %s\n", rank++, l.dp, l.cp,
              l.tp, l.pp, l.virtual_stages, l.micro_batch, l.zero, int(l.sequence_parallel), recompute_name(l.recompute),
              p.memory_known ? format("%.2f", double(p.memory_total) / 1e9).c_str() : "?", p.time.step_s,
              p.tokens_per_s, p.model_tflops, 100 * p.mfu, big.c_str());
  }
  (void)c;
  return s;
}

std::string explain(const Prediction& p, const Workload& w, const Cluster& c) {
  const StepTime& t = p.time;
  std::string s = format("layout %s on %s (%d devices)\n", p.layout.str().c_str(), c.name.c_str(), p.layout.devices());
  s += format("  model: %d layers, d_model %d, %d heads, seq %d, vocab %d; %.4g GFLOP/token per layer, %.4g rest\n",
            w.cfg.model.n_layer, w.cfg.model.d_model, w.cfg.model.n_head, w.cfg.seq_len(), w.cfg.model.padded_vocab(),
            w.layer_flops_per_token / 1e9, w.head_flops_per_token / 1e9);
  s += "  step time, by term (busiest pipeline stage):\n";
  for (const auto& [name, v] : terms(t)) s += format("    %-16s %10.4g s  %5.1f%%\n", name, v, 100 * v / t.step_s);
  s += format("    %-16s %10.4g s\n", "step", t.step_s);
  if (p.layout.recompute == Recompute::Full)
    s += "    (recomputation: train.recompute=full, each block's forward again before its backward ('recompute');\n"
         "     activations measured by the trainer's own accounting for that mode)\n";
  if (p.layout.recompute == Recompute::Selective)
    s += "    (recomputation: train.recompute=selective, each layer's attention core and MLP activation again\n"
         "     before its backward ('recompute'); activations measured by the trainer's own accounting for that mode)\n";
  for (const auto& [k, v] : t.notes) s += format("  %s: %s\n", k.c_str(), v.c_str());
  s += format("  throughput: %.5g tokens/s, %.1f model TFLOP/s per device (%.1f counting recomputation), MFU %.1f%%\n",
            p.tokens_per_s, p.model_tflops, p.hardware_tflops, 100 * p.mfu);
  if (p.memory_known) {
    s += "  memory per device (largest stage; the trainer's plan):\n";
    for (const auto& it : p.memory.items())
      s += format("    %-22s %12s  %s\n", it.category.c_str(), format_bytes(it.bytes).c_str(), it.detail.c_str());
    s += format("    %-22s %12s  of %.1f GB usable: %s\n", "total", format_bytes(p.memory_total).c_str(),
              c.usable_memory_bytes() / 1e9, p.fits ? "fits" : "does NOT fit");
  }
  return s;
}

nlohmann::json to_json(const Prediction& p) {
  const PlanLayout& l = p.layout;
  nlohmann::json j;
  j["layout"] = {{"dp", l.dp}, {"cp", l.cp}, {"tp", l.tp}, {"pp", l.pp}, {"virtual_stages", l.virtual_stages},
                 {"micro_batch", l.micro_batch}, {"zero", l.zero}, {"sequence_parallel", l.sequence_parallel},
                 {"recompute", recompute_name(l.recompute)}};
  nlohmann::json mem = nlohmann::json::object();
  for (const auto& it : p.memory.items()) mem[it.category] = it.bytes;
  mem["total"] = p.memory_total;
  j["memory_bytes"] = mem;
  j["fits"] = p.fits;
  nlohmann::json br = nlohmann::json::object();
  for (const auto& [name, v] : terms(p.time)) br[std::string(name) + "_s"] = v;
  j["breakdown_s"] = br;
  j["step_s"] = p.time.step_s;
  j["tokens_per_s"] = p.tokens_per_s;
  j["tflops_per_device"] = p.model_tflops;
  j["hardware_tflops_per_device"] = p.hardware_tflops;
  j["mfu"] = p.mfu;
  return j;
}

}  // namespace xirang::analysis::plan
