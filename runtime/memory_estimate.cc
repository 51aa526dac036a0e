#include "runtime/memory_estimate.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "kernels/context_split.h"
#include "kernels/group_table.h"
#include "runtime/config/model_layout.h"
#include "runtime/step/optimizer.h"
#include "runtime/step/pipeline.h"
#include "runtime/step/schedule.h"

namespace xirang {

namespace {

// Mirrors runtime/step/pipeline.cc (kGradBuffers, kSendBuffers).
constexpr int kGradBuffers = 2, kSendBuffers = 2;

DType model_dtype(const Config& c) {
  switch (c.precision.dtype) {
    case Precision::BF16: return DType::BF16;
    case Precision::FP16: return DType::F16;
    case Precision::FP32: break;
  }
  return DType::F32;
}

size_t aligned(int64_t elems, size_t elem_bytes) {
  const size_t b = size_t(elems) * elem_bytes;
  return (b + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
}

// One rank's chunks, built layout-only, with their activation slots.
struct RankModel {
  std::vector<std::unique_ptr<ModelChunk>> chunks;
  int slots = 1;
  SlotCounts pools;  // the trainer's slot counts (input and weight: a split backward's)
};

RankModel build_rank(const Config& cfg, RankCoords at, int slots_override) {
  const ModelDims& dims = cfg.model;
  const ModelArch& arch = model_arch(dims.arch);
  const int p = cfg.parallel.pp, v = cfg.parallel.virtual_stages, tp = cfg.parallel.tp;
  const auto kind = cfg.parallel.schedule;
  RankModel r;
  r.pools = slot_counts(make_schedule(kind, p, at.pp_rank, cfg.microbatches(), v), v, p > 1 ? 2 : 0);
  r.slots = r.pools.activation;
  // Measuring one slot's bytes: every pool of that size.
  if (slots_override > 0) r.slots = slots_override, r.pools = {slots_override, slots_override, slots_override};
  const ChunkMap map = chunk_map(cfg.parallel);
  for (int c = 0; c < v; ++c) {
    r.chunks.push_back(arch.make_chunk(dims, map.placement(dims.n_layer, at.pp_rank, c), model_dtype(cfg),
                                       chunk_batch(cfg, r.slots, r.pools.input, r.pools.weight),
                                       TensorParallel{nullptr, cfg.parallel.sequence_parallel, tp > 1 ? tp : 0,
                                                      at.tp_rank}));
  }
  return r;
}

// A cp rank's rows of each sequence: T / cp (T when cp = 1), as ContextSplit lays them out.
int64_t rows_per_sequence(const Config& cfg) {
  return ContextSplit::of(cfg.seq_len(), cfg.parallel.cp).local_rows();
}

// PipelineExecutor::layout: token and target slots where the executor
// feeds them (holds_tokens, holds_targets), received and sent gradient
// buffers between chunks.
void layout_executor(const RankModel& r, const Config& cfg, int pp_rank, Arena& a) {
  const int v = cfg.parallel.virtual_stages;
  const ChunkMap map = chunk_map(cfg.parallel);
  const int64_t B = cfg.train.micro_batch, T = rows_per_sequence(cfg);
  for (int c = 0; c < v; ++c) {
    const ModelChunk& m = *r.chunks[size_t(c)];
    const int g = map.model_chunk(pp_rank, c);
    const bool first = g == 0, last = g == map.chunks() - 1;
    for (int s = 0; s < r.slots; ++s) {
      if (PipelineExecutor::holds_tokens(map, pp_rank, c)) a.alloc({B, T}, DType::I32, "pipeline tokens");
      if (PipelineExecutor::holds_targets(map, pp_rank, c)) a.alloc({B, T}, DType::I32, "pipeline targets");
    }
    const Shape rows = const_cast<ModelChunk&>(m).input_grad().shape();
    if (!last)
      for (int i = 0; i < kGradBuffers; ++i) a.alloc(rows, m.dtype(), "received output gradient");
    if (!first)
      for (int i = 0; i < kSendBuffers; ++i) a.alloc(rows, m.dtype(), "input gradient send");
  }
}

// GradSync's buckets over the flat parameter buffer (runtime/step/grad_sync.cc):
// this rank's pieces, as optimizer segments, and the shard's length. ZeRO-1
// shards over the dp x cp ranks (`dp_rank` is the rank in that group).
std::vector<OptimizerSegment> zero_segments(const std::vector<Parameter*>& params, const Config& cfg, int dp_rank,
                                            int64_t* shard_elems) {
  const DType pdt = params.front()->value.dtype(), gdt = params.front()->grad.dtype();
  const size_t pes = dtype_size(pdt), es = dtype_size(gdt);
  std::vector<int64_t> offset;
  int64_t at = 0;
  for (const Parameter* p : params) {
    offset.push_back(at);
    at += int64_t(aligned(p->value.numel(), pes) / pes);
  }
  const int64_t align = int64_t(Arena::kAlignment / es);
  const int64_t total = (offset.back() + params.back()->value.numel() + align - 1) / align * align;
  const int64_t bucket_elems = std::max<int64_t>(1, int64_t(cfg.parallel.bucket_mb * 1024 * 1024 / double(es)));
  std::vector<OptimizerSegment> segs;
  *shard_elems = 0;
  int64_t end = total;
  std::vector<int> cur;
  for (int i = int(params.size()) - 1; i >= 0; --i) {
    cur.push_back(i);
    const int64_t begin = offset[size_t(i)];
    if (end - begin < bucket_elems && i != 0) continue;
    auto [c0, c1] = split_range(end - begin, cfg.parallel.dp * cfg.parallel.cp, dp_rank);
    const int64_t cb = begin + c0, ce = begin + c1;
    *shard_elems += ce - cb;
    for (int q : cur) {
      const int64_t p0 = offset[size_t(q)], p1 = p0 + params[size_t(q)]->value.numel();
      const int64_t s0 = std::max(p0, cb), s1 = std::min(p1, ce);
      if (s0 < s1) segs.push_back({Tensor(nullptr, {s1 - s0}, pdt), Tensor(nullptr, {s1 - s0}, gdt), true});
    }
    end = begin;
    cur.clear();
  }
  return segs;
}

}  // namespace

MemoryPlan estimate_memory(const Config& cfg, RankCoords at) {
  RankModel r = build_rank(cfg, at, 0);
  Arena mp = Arena::measuring("parameters"), mg = Arena::measuring("gradients");
  Arena ms = Arena::measuring("optimizer state"), mz = Arena::measuring("gradient shard");
  Arena ma = Arena::measuring("activations");
  for (auto& c : r.chunks) c->layout_parameters(mp, mg);
  for (auto& c : r.chunks) c->layout_activations(ma);
  layout_executor(r, cfg, at.pp_rank, ma);
  std::vector<Parameter*> params;
  for (auto& c : r.chunks)
    for (Parameter& p : c->parameters()) params.push_back(&p);
  AdamW opt(cfg.train);
  const bool zero = cfg.parallel.zero == 1;
  if (zero) {
    int64_t shard = 0;
    opt.set_segments(zero_segments(params, cfg, at.dp_rank * cfg.parallel.cp + at.cp_rank, &shard));
    mz.alloc({shard}, params.front()->grad.dtype(), "ZeRO gradient shard");
  } else {
    std::vector<OptimizerSegment> segs;
    for (Parameter* p : params) segs.push_back({p->value.flat(), p->grad.flat(), p->decay});
    opt.set_segments(std::move(segs));
  }
  mz.alloc({1}, DType::F64, "gradient norm sum");  // GradSync::layout
  int64_t norm_elements = 0;
  for (const OptimizerSegment& seg : opt.segments()) norm_elements += seg.param.numel();
  mz.alloc({group_table_words(int64_t(opt.segments().size()), norm_elements)}, DType::U32,
           "gradient norm chunk table");
  opt.layout_state(ms);
  const size_t io = 2 * size_t(cfg.train.micro_batch) * size_t(rows_per_sequence(cfg)) * 4 + 2 * Arena::kAlignment;
  MemoryPlan plan;
  plan.add("parameters", mp.used());
  plan.add("gradients", mg.used());
  plan.add("optimizer state", ms.used());
  if (zero) plan.add("gradient shard", mz.used());
  plan.add("activations", ma.used());
  plan.add("input batch", io);
  return plan;
}

MemoryPlan estimate_peak_memory(const Config& cfg, int* pp_rank_out) {
  MemoryPlan best = estimate_memory(cfg, {0, 0, 0});
  int rank = 0;
  if (cfg.parallel.pp > 1) {
    MemoryPlan last = estimate_memory(cfg, {cfg.parallel.pp - 1, 0, 0});
    if (last.total() > best.total()) best = last, rank = cfg.parallel.pp - 1;
  }
  if (pp_rank_out) *pp_rank_out = rank;
  return best;
}

ActivationSplit activation_split(const Config& cfg, RankCoords at) {
  auto measure = [&](int slots) {
    RankModel r = build_rank(cfg, at, slots);
    Arena ma = Arena::measuring("activations");
    for (auto& c : r.chunks) c->layout_activations(ma);
    layout_executor(r, cfg, at.pp_rank, ma);
    return ma.used();
  };
  const size_t one = measure(1), two = measure(2);
  ActivationSplit s;
  s.per_slot = two - one;
  s.fixed = one - s.per_slot;
  s.slots = build_rank(cfg, at, 0).slots;
  for (auto& c : build_rank(cfg, at, 1).chunks) s.layers += c->placement().end_layer - c->placement().first_layer;
  return s;
}

}  // namespace xirang
