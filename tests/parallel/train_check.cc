// Layout equivalence under MPI: every parallel layout trains exactly like
// one rank.
//
//   mpirun -np 4 parallel_train_check --data DIR --set parallel.zero=1 [--steps 10] [--tol 1e-5]
//                                     [--update-tol T] [--resumed-from K] [--config configs/llama_debug.yaml]
//                                     [--against-none] [--against KEY=VALUE ...] [--against-tol T]
//
// The model is configs/gpt2_debug.yaml's unless --config names another
// (relative to the source tree).
//
// World rank 0 first trains the single-rank reference (parallel.dp = tp = pp
// = 1, same global batch and seed) on its own; then every rank trains the
// layout given by the overrides on the process grid. Rank 0 checks that both
// ran the expected number of steps, and compares the per-step losses
// (relative difference < --tol, 1e-5 unless given) and the updates: for
// every parameter tensor, the layout's change since initialisation, w_final
// - w_init, against the reference's, as ||dw_layout - dw_ref|| / ||dw_ref||
// < --update-tol (1e-3 unless given), over the elements each rank's
// optimizer holds (its shard, its ZeRO-1 piece). The weights compared are
// those the optimizer updates: the fp32 masters under precision.dtype=
// bf16/fp16 (whose reference is one rank in the same dtype), the parameters
// otherwise. A shard that never updated is off by exactly 1 whatever the
// dtype. In fp32 the final parameters must also be within
// max(--tol, --param-tol) (5e-5 unless given) of the largest parameter. Every rank checks that its replica equals
// rank 0's bit for bit. Prints one line per check and a closing "N passed, M
// failed"; exits non-zero on any failure.
//
// Bitwise against another setting: with --against KEY=VALUE (repeatable)
// the layout trains a second time with those overrides on the same grid,
// and its per-step losses and final parameters must be bitwise those of the
// first run: train.recompute=none against recomputation (--against-none is
// --against train.recompute=none), parallel.schedule=1f1b against a
// zero-bubble schedule (with parallel.virtual_stages=1 against zb_v, whose
// V places other layers on each rank). The parameters are compared as the
// whole model: every rank's elements put at their place in the
// reference's concatenation. With --against-tol T the two runs need
// only agree within T: per-step losses relative, every rank's parameters
// within T of its largest (parallel.cp_comm=ring against all_gather: the
// ring merges per-block softmaxes and sums gradients in another order).
//
// Checkpoints: with --set train.stop_after=K --set checkpoint.dir=D the
// layout stops after K steps and saves; with --set checkpoint.resume=D/step_K
// (in any layout) and --resumed-from K it must resume there, and its steps
// K+1.. are compared with the uninterrupted single-rank run's (its updates
// too, counted from the common initialisation).
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/mpi_runtime.h"
#include "comm/process_grid.h"
#include "core/rng.h"
#include "runtime/comm_groups.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/config.h"
#include "runtime/config/model_layout.h"
#include "runtime/memory_estimate.h"
#include "runtime/trainer.h"

using namespace xirang;

namespace {

struct Args {
  std::string data;
  std::string config = "configs/gpt2_debug.yaml";
  std::vector<std::string> overrides;
  int steps = 10;
  double tol = 1e-5;         // relative, for the per-step losses
  double update_tol = 1e-3;  // per tensor, ||dw - dw_ref|| / ||dw_ref||
  // fp32 final parameters, of the largest one. AdamW turns the rounding of a
  // near-zero gradient component into up to lr per step; split products
  // (tp) sum in another order than one rank's, so a few elements of the
  // final parameters differ by more than the losses do (1.2e-5 in tp4 on the
  // oneDNN path). The update check above is the strict one.
  double param_tol = 5e-5;
  int resumed_from = 0;      // the step the layout must start from (a checkpoint's)
  std::vector<std::string> against;  // also train the layout with these overrides: bitwise the same
  double against_tol = 0;            // > 0: the same within this instead of bitwise
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--data" && i + 1 < argc) a.data = argv[++i];
    else if (s == "--set" && i + 1 < argc) a.overrides.push_back(argv[++i]);
    else if (s == "--config" && i + 1 < argc) a.config = argv[++i];
    else if (s == "--steps" && i + 1 < argc) a.steps = std::stoi(argv[++i]);
    else if (s == "--tol" && i + 1 < argc) a.tol = std::stod(argv[++i]);
    else if (s == "--update-tol" && i + 1 < argc) a.update_tol = std::stod(argv[++i]);
    else if (s == "--param-tol" && i + 1 < argc) a.param_tol = std::stod(argv[++i]);
    else if (s == "--resumed-from" && i + 1 < argc) a.resumed_from = std::stoi(argv[++i]);
    else if (s == "--against-none") a.against.push_back("train.recompute=none");
    else if (s == "--against" && i + 1 < argc) a.against.push_back(argv[++i]);
    else if (s == "--against-tol" && i + 1 < argc) a.against_tol = std::stod(argv[++i]);
    else fail(ErrorKind::Usage, "parallel_train_check: unexpected argument '", s, "'");
  }
  if (a.data.empty()) fail(ErrorKind::Usage, "parallel_train_check: --data DIR is required");
  return a;
}

Config make_config(const Args& a, std::vector<std::string> extra, int world) {
  std::vector<std::string> o = {"data.train=" + a.data + "/train", "train.steps=" + std::to_string(a.steps),
                                "metrics.jsonl="};
  o.insert(o.end(), a.overrides.begin(), a.overrides.end());
  o.insert(o.end(), extra.begin(), extra.end());
  Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/" + a.config, o);
  validate(c, world);
  return c;
}

// One parameter's elements as float, whatever the model's dtype.
std::vector<float> as_floats(const Parameter& p) {
  std::vector<float> out(size_t(p.value.numel()));
  convert_elements(p.value.raw(), p.value.dtype(), out.data(), DType::F32, p.value.numel());
  return out;
}

// The bits of every parameter element this rank holds, at its index in the
// reference's concatenation, OR-ed over the world (the other elements 0):
// the whole model, whatever the layout. Replicas that differ do not OR to
// either's bits, so they cannot compare equal to a layout whose replicas agree.
std::vector<uint32_t> whole_model_bits(Trainer& t, const std::map<std::string, size_t>& ref_offset, size_t ref_size) {
  std::vector<uint32_t> bits(ref_size, 0);
  for (auto& p : t.parameters()) {
    const std::vector<float> v = as_floats(p);
    const size_t base = ref_offset.at(p.name);
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      uint32_t b;
      std::memcpy(&b, &v[size_t(i)], 4);
      bits[base + size_t(p.shard.global_index(p.value.shape(), i))] |= b;
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, bits.data(), int(ref_size), MPI_UINT32_T, MPI_BOR, MPI_COMM_WORLD);
  return bits;
}

// All parameters, concatenated in order (the single-rank reference's are full tensors).
std::vector<float> flat_params(Trainer& t) {
  std::vector<float> out;
  for (auto& p : t.parameters()) {
    const std::vector<float> v = as_floats(p);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// (index in the reference's concatenation, value) of every weight this rank's
// optimizer updates: the fp32 masters under 16-bit parameters, the
// parameters otherwise. Each segment is a parameter or, under ZeRO-1, this
// rank's piece of one; the tied token table's last-stage copy counts too.
std::vector<std::pair<size_t, float>> optimizer_weights(Trainer& t, const std::map<std::string, size_t>& ref_offset) {
  std::vector<std::pair<size_t, float>> out;
  const AdamW& opt = t.optimizer();
  const auto& segs = opt.segments();
  for (size_t s = 0; s < segs.size(); ++s) {
    const Parameter& p = t.parameters()[size_t(segs[s].param_index)];
    const Tensor& w = opt.has_master() ? opt.master()[s] : segs[s].param;
    std::vector<float> v(size_t(w.numel()));
    convert_elements(w.raw(), w.dtype(), v.data(), DType::F32, w.numel());
    const size_t base = ref_offset.at(p.name);
    for (int64_t i = 0; i < w.numel(); ++i)
      out.emplace_back(base + size_t(p.shard.global_index(p.value.shape(), segs[s].param_offset + i)), v[size_t(i)]);
  }
  return out;
}

// The single-rank reference: the same model, data, seed and global batch.
const std::vector<std::string> kOneRank = {"parallel.dp=1", "parallel.cp=1", "parallel.tp=1", "parallel.pp=1", "parallel.zero=0",
                                           "parallel.sequence_parallel=false", "parallel.schedule=1f1b",
                                           "parallel.virtual_stages=1"};

int passed = 0, failed = 0;

std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2e", x);
  return buf;
}

void check(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
  (ok ? passed : failed)++;
}

// Whether the arenas `tr` allocated (its memory plan: each arena is sized
// by the carving code it lays out) are estimate_memory's for this rank's
// coordinates, category for category, byte for byte.
int plan_matches_estimate(const Config& c, const Trainer& tr, const ProcessGrid& g) {
  const GridCoords& at = g.coords();
  const MemoryPlan want = estimate_memory(c, RankCoords{at.pp, at.tp, at.dp, at.cp});
  const MemoryPlan& got = tr.memory_plan();
  int ok = 1;
  for (const auto& item : got.items())
    if (item.category != "checkpoint snapshot" && want.bytes_of(item.category) != item.bytes) {
      std::fprintf(stderr, "rank %d: %s: arenas %zu bytes, estimate %zu\n", g.world_rank(), item.category.c_str(),
                   item.bytes, want.bytes_of(item.category));
      ok = 0;
    }
  for (const auto& item : want.items())
    if (got.bytes_of(item.category) != item.bytes) {
      std::fprintf(stderr, "rank %d: %s: estimate %zu bytes, arenas %zu\n", g.world_rank(), item.category.c_str(),
                   item.bytes, got.bytes_of(item.category));
      ok = 0;
    }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const int rank = mpi.world_rank(), world = mpi.world_size();
  try {
    Args args = parse(argc, argv);
    TrainerOptions quiet;
    quiet.print = false;
    quiet.peak = PeakFlops{1e11, "test"};

    // Where each parameter starts in the reference's concatenation: the
    // single-rank model's parameter order, known to every rank without data.
    std::map<std::string, size_t> ref_offset;
    std::vector<std::string> names;  // in that order
    size_t ref_size = 0;
    {
      const Config one = make_config(args, kOneRank, 1);
      const ModelDims& dims = one.model;
      for (auto& p : model_arch(dims.arch).parameters(dims, ChunkPlacement::whole(dims.n_layer), 1, 0)) {
        ref_offset[p.name] = ref_size;
        names.push_back(p.name);
        ref_size += size_t(p.shard.global.numel());
      }
    }

    std::vector<double> ref_losses;
    std::optional<double> ref_val;  // with data.val and train.eval_every: the last evaluation
    std::vector<float> ref_params, ref_init(ref_size), ref_final(ref_size);  // init/final: the optimizer's weights
    size_t ref_opt_bytes = 0;
    if (rank == 0) {
      // The uninterrupted reference: no early stop, no checkpoints.
      std::vector<std::string> one = kOneRank;
      one.insert(one.end(), {"train.stop_after=0", "checkpoint.dir=", "checkpoint.resume=none"});
      Trainer ref(make_config(args, one, 1), quiet);
      ref_opt_bytes = ref.memory_plan().bytes_of("optimizer state");
      for (auto& [i, v] : optimizer_weights(ref, ref_offset)) ref_init[i] = v;
      TrainResult rr = ref.run();
      ref_losses = rr.losses;
      ref_val = rr.final_val_loss;
      ref_params = flat_params(ref);
      for (auto& [i, v] : optimizer_weights(ref, ref_offset)) ref_final[i] = v;
    }
    MPI_Barrier(MPI_COMM_WORLD);

    Config cfg = make_config(args, {}, world);
    auto grid = ProcessGrid::create_mpi(GridShape{cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp,
                                                  cfg.parallel.ep},
                                        comm_options(cfg),
                                        LinkModel{cfg.comm.latency_us, cfg.comm.bandwidth_gbps});
    Trainer t(cfg, quiet, grid.get());
    TrainResult r = t.run();
    std::vector<float> params = flat_params(t);

    // The same layout with the --against overrides: bitwise the same losses and parameters on every rank.
    int against_same = 1, plan_same = plan_matches_estimate(cfg, t, *grid);
    const std::vector<uint32_t> model_bits = args.against.empty() ? std::vector<uint32_t>()
                                                                  : whole_model_bits(t, ref_offset, ref_size);
    unsigned long long against_acts = 0;  // the --against run's activations arena
    std::vector<double> against_losses;
    if (!args.against.empty()) {
      const Config against_cfg = make_config(args, args.against, world);
      Trainer other(against_cfg, quiet, grid.get());
      plan_same = std::min(plan_same, plan_matches_estimate(against_cfg, other, *grid));
      against_acts = other.memory_plan().bytes_of("activations");
      TrainResult pr = other.run();
      against_losses = pr.losses;
      const std::vector<float> pp = flat_params(other);
      if (args.against_tol > 0) {
        against_same = pp.size() == params.size() && pr.losses.size() == r.losses.size();
        double worst_loss = 0, worst_param = 0, largest = 1;
        for (size_t i = 0; against_same && i < r.losses.size(); ++i)
          worst_loss = std::max(worst_loss, std::abs(pr.losses[i] - r.losses[i]) / std::abs(pr.losses[i]));
        for (size_t i = 0; against_same && i < params.size(); ++i) {
          worst_param = std::max(worst_param, double(std::abs(pp[i] - params[i])));
          largest = std::max(largest, double(std::abs(pp[i])));
        }
        against_same = against_same && worst_loss <= args.against_tol && worst_param <= args.against_tol * largest;
        if (rank == 0)
          std::printf("  against: largest loss difference %.3g relative, parameter difference %.3g of %.3g\n",
                      worst_loss, worst_param, largest);
      } else {
        against_same = whole_model_bits(other, ref_offset, ref_size) == model_bits &&
                       pr.losses.size() == r.losses.size() &&
                       std::memcmp(pr.losses.data(), r.losses.data(), r.losses.size() * sizeof(double)) == 0;
      }
    }
    int all_against_same = 0;
    MPI_Allreduce(&against_same, &all_against_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);

    // The memory plan of every rank (its arenas) against the estimate for
    // its coordinates, in both runs; each rank's activations arena in both.
    int all_plan_same = 0;
    MPI_Allreduce(&plan_same, &all_plan_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    unsigned long long acts[3] = {(unsigned long long)grid->coords().pp, t.memory_plan().bytes_of("activations"),
                                  against_acts};
    std::vector<unsigned long long> all_acts(rank == 0 ? size_t(3 * world) : 0);
    MPI_Gather(acts, 3, MPI_UNSIGNED_LONG_LONG, all_acts.data(), 3, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);

    // Each rank compares its shards with the matching slices of the reference.
    ref_params.resize(ref_size);
    MPI_Bcast(ref_params.data(), int(ref_size), MPI_FLOAT, 0, MPI_COMM_WORLD);
    MPI_Bcast(ref_init.data(), int(ref_size), MPI_FLOAT, 0, MPI_COMM_WORLD);
    MPI_Bcast(ref_final.data(), int(ref_size), MPI_FLOAT, 0, MPI_COMM_WORLD);

    // The updates, per tensor and rank: sums of (dw - dw_ref)^2 and dw_ref^2
    // over the elements of the tensor this rank's optimizer holds (its
    // tensor-parallel shard, its ZeRO-1 piece, its replica). A rank whose
    // shard never updated has dw = 0 there: a ratio of exactly 1.
    std::vector<size_t> tensor_of(ref_size);
    for (size_t k = 0; k < names.size(); ++k)
      for (size_t i = ref_offset[names[k]], e = k + 1 < names.size() ? ref_offset[names[k + 1]] : ref_size; i < e; ++i)
        tensor_of[i] = k;
    std::vector<double> upd(2 * names.size(), 0.0);  // [2k]: sum (dw - dw_ref)^2, [2k+1]: sum dw_ref^2
    for (auto& [i, v] : optimizer_weights(t, ref_offset)) {
      const double dw = double(v) - ref_init[i], dref = double(ref_final[i]) - ref_init[i];
      upd[2 * tensor_of[i]] += (dw - dref) * (dw - dref);
      upd[2 * tensor_of[i] + 1] += dref * dref;
    }
    struct {
      double ratio;
      int tensor;
    } worst_update{0.0, -1};
    for (size_t k = 0; k < names.size(); ++k) {
      if (upd[2 * k] == 0 && upd[2 * k + 1] == 0) continue;  // none of it here (or it never moves)
      // A piece the reference never moved has no scale to compare with: any change is all wrong.
      const double rel = upd[2 * k + 1] > 0 ? std::sqrt(upd[2 * k] / upd[2 * k + 1]) : 1.0;
      if (rel >= worst_update.ratio) worst_update = {rel, int(k)};
    }
    MPI_Allreduce(MPI_IN_PLACE, &worst_update, 1, MPI_DOUBLE_INT, MPI_MAXLOC, MPI_COMM_WORLD);
    const std::string worst_tensor = worst_update.tensor >= 0 ? names[size_t(worst_update.tensor)] : "none";

    double diff_scale[2] = {0, 0};
    for (auto& p : t.parameters()) {
      const size_t base = ref_offset.at(p.name);
      const std::vector<float> v = as_floats(p);
      for (int64_t i = 0; i < p.value.numel(); ++i) {
        const float ref = ref_params[base + size_t(p.shard.global_index(p.value.shape(), i))];
        diff_scale[0] = std::max(diff_scale[0], double(std::abs(v[i] - ref)));
        diff_scale[1] = std::max(diff_scale[1], double(std::abs(ref)));
      }
    }
    MPI_Allreduce(MPI_IN_PLACE, diff_scale, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

    // Data-parallel replicas: every rank's parameters hash to those of the
    // first rank of its dp group (same tensor-parallel shards).
    uint64_t h = 1469598103934665603ull;
    for (float v : params) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      h = (h ^ bits) * 1099511628211ull;
    }
    uint32_t h0[2] = {uint32_t(h), uint32_t(h >> 32)};
    grid->dp_cp().broadcast(Tensor(h0, {2}, DType::U32), 0);  // every copy: dp x cp
    int same = h0[0] == uint32_t(h) && h0[1] == uint32_t(h >> 32), all_same = 0;
    MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);

    // The tied token table's two copies (first and last pipeline chunk) stay identical:
    // compared here when this rank holds both (zb_v's rank 0), else over the embedding group.
    int tied_same = 1, all_tied_same = 0, any_tied = 0;
    std::vector<const Parameter*> tied_here;
    for (auto& p : t.parameters())
      if (p.tied) tied_here.push_back(&p);
    if (tied_here.size() == 2) {
      any_tied = 1;
      tied_same = tied_here[0]->value.bytes() == tied_here[1]->value.bytes() &&
                  std::memcmp(tied_here[0]->value.raw(), tied_here[1]->value.raw(), tied_here[0]->value.bytes()) == 0;
    } else if (cfg.parallel.pp > 1 && grid->embedding().size() == 2) {
      for (auto& p : t.parameters())
        if (p.tied) {
          any_tied = 1;
          std::vector<char> other(static_cast<const char*>(p.value.raw()),
                                  static_cast<const char*>(p.value.raw()) + p.value.bytes());
          grid->embedding().broadcast(Tensor(other.data(), {p.value.numel()}, p.value.dtype()), 0);
          tied_same = std::memcmp(other.data(), p.value.raw(), p.value.bytes()) == 0;
        }
    }
    MPI_Allreduce(&tied_same, &all_tied_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &any_tied, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);

    if (rank == 0) {
      std::printf("%s: layout dp=%d cp=%d tp=%d pp=%d (%s, v=%d) zero=%d sp=%d overlap=%d bucket_mb=%g, %d ranks, %d steps\n",
                  cfg.model.arch.c_str(), cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.pp,
                  schedule_name(cfg.parallel.schedule),
                  cfg.parallel.virtual_stages, cfg.parallel.zero,
                  int(cfg.parallel.sequence_parallel), int(cfg.parallel.overlap_grad_reduce), cfg.parallel.bucket_mb,
                  world, args.steps);
      double worst = 0;
      const size_t first = size_t(t.start_step());  // a resumed run starts after its checkpoint
      if (first > 0) std::printf("  resumed at step %zu\n", first);
      // How many steps ran: the reference all of them, the layout from where
      // it resumed to train.stop_after (or the end).
      const int last = cfg.train.stop_after > 0 ? std::min(cfg.train.stop_after, args.steps) : args.steps;
      check(int(ref_losses.size()) == args.steps,
            "the reference ran " + std::to_string(ref_losses.size()) + " steps, expected " + std::to_string(args.steps));
      check(int(first) == args.resumed_from,
            "the layout started after step " + std::to_string(first) + ", expected " + std::to_string(args.resumed_from));
      check(!r.losses.empty() && int(first + r.losses.size()) == last,
            "the layout ran " + std::to_string(r.losses.size()) + " steps to step " +
                std::to_string(first + r.losses.size()) + ", expected to step " + std::to_string(last));

      for (size_t i = 0; i < r.losses.size() && first + i < ref_losses.size(); ++i) {
        const double ref = ref_losses[first + i];
        const double rel = std::abs(r.losses[i] - ref) / std::abs(ref);
        worst = std::max(worst, rel);
        std::printf("  step %2zu  loss %.8f  single rank %.8f  rel diff %.2e\n", first + i + 1, r.losses[i], ref, rel);
      }
      check(worst < args.tol, "per-step losses within " + sci(args.tol) + " relative of one rank (worst " + sci(worst) + ")");
      const bool finished = int(first + r.losses.size()) == args.steps;
      if (finished) {
        check(worst_update.ratio < args.update_tol,
              "every rank's update of every tensor (w_final - w_init" +
                  std::string(t.optimizer().has_master() ? ", fp32 masters" : "") + ") within " +
                  sci(args.update_tol) + " of one rank's, relative to its size (worst " + sci(worst_update.ratio) +
                  ", " + worst_tensor + ")");
        if (t.model_dtype() == DType::F32)
          check(diff_scale[0] / diff_scale[1] < std::max(args.tol, args.param_tol),
                "final parameters (every rank's shards) within " + sci(std::max(args.tol, args.param_tol)) +
                    " of one rank (largest difference " +
                    sci(diff_scale[0] / diff_scale[1]) + " of the largest parameter)");
      }
      check(all_same == 1, "every data- and context-parallel copy's parameters equal its group's first rank's bit for bit");
      if (cfg.parallel.pp > 1 && any_tied)
        check(all_tied_same == 1, "the tied token table is bitwise the same on the first and the last stage");
      check(r.losses.size() < 2 || r.losses.back() < r.losses.front(), "the loss went down");
      check(all_plan_same == 1, "every rank's arenas are estimate_memory's plan for its coordinates, byte for byte");
      {
        std::vector<unsigned long long> most(size_t(cfg.parallel.pp) * 2, 0);
        for (int w = 0; w < world; ++w)
          for (int k = 0; k < 2; ++k) {
            unsigned long long& m = most[size_t(all_acts[size_t(3 * w)]) * 2 + size_t(k)];
            m = std::max(m, all_acts[size_t(3 * w + 1 + k)]);
          }
        unsigned long long peak[2] = {0, 0};
        for (int s = 0; s < cfg.parallel.pp; ++s) {
          std::printf("  activations arena, pipeline rank %d: %llu bytes%s\n", s, most[size_t(2 * s)],
                      args.against.empty() ? ""
                                           : str_cat(", ", most[size_t(2 * s + 1)], " with the --against overrides").c_str());
          for (int k = 0; k < 2; ++k) peak[k] = std::max(peak[k], most[size_t(2 * s + k)]);
        }
        if (!args.against.empty())
          std::printf("  activations arena, most of any rank: %.3fx the --against run's\n",
                      double(peak[0]) / double(peak[1]));
      }
      if (!args.against.empty()) {
        std::string other;
        for (const std::string& o : args.against) other += (other.empty() ? "" : " ") + o;
        for (size_t i = 0; i < r.losses.size() && i < against_losses.size(); ++i)
          std::printf("  step %2zu  loss %.17g  %s %.17g\n", i + 1, r.losses[i], other.c_str(), against_losses[i]);
        check(all_against_same == 1, "per-step losses and " +
                                      (args.against_tol > 0 ? "every rank's parameters within " + sci(args.against_tol) + " of"
                                                            : "the whole model's parameters bitwise") +
                                      " those of " + other + " on the same grid");
      }
      if (ref_val && finished) {
        // Evaluation sends stage outputs forward on the pipeline's activation queues.
        const double rel = r.final_val_loss ? std::abs(*r.final_val_loss - *ref_val) / *ref_val : 1.0;
        check(rel < args.tol, "final validation loss within " + sci(args.tol) + " relative of one rank's (" +
                                  (r.final_val_loss ? std::to_string(*r.final_val_loss) : "none") + " vs " +
                                  std::to_string(*ref_val) + ")");
      }
      // ZeRO-1 keeps 1/dp of the AdamW state per rank (plus alignment padding of its pieces).
      const double opt = double(t.memory_plan().bytes_of("optimizer state"));
      // Tensor parallelism shrinks the state only for split parameters, so this check is for tp=1.
      const double expect = double(ref_opt_bytes) / (cfg.parallel.zero ? cfg.parallel.dp * cfg.parallel.cp : 1);
      if (cfg.parallel.tp == 1 && cfg.parallel.pp == 1)
        check(opt >= 0.99 * expect && opt <= 1.02 * expect + 65536,
            "optimizer state per rank " + std::to_string(size_t(opt)) + " bytes, expected about " +
                std::to_string(size_t(expect)) + (cfg.parallel.zero ? " (1/(dp cp) of one rank's)" : " (as one rank)"));
      std::printf("%d passed, %d failed\n", passed, failed);
    }
    int bad = failed, any_bad = 0;
    MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return any_bad ? 1 : 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "parallel_train_check: rank %d: %s: %s\n", rank, error_kind_name(e.kind()), e.what());
    MpiRuntime::abort_world(1);
  }
}
