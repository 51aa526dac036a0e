// Activation recomputation (ChunkBatch::recompute): for GPT-2, LLaMA and
// Qwen3, in fp32, bf16 and fp16, one chunk or a two-chunk pipeline with two
// microbatches in flight, `selective` and `full` give the losses, every
// parameter gradient and the input gradients bitwise equal to `none`, and
// keep fewer activation bytes.
//
// The backward split into its input- and weight-gradient parts
// (BackwardPart, ChunkBatch::split_backward), in every recompute mode, with
// each microbatch's weight part right after its input part or all input
// parts first: the same losses, gradients, input gradients and
// gradient-ready calls (in the same order, all from the weight parts) as
// the fused backward. The activation slot is free after the input part:
// a forward reusing it before the weight part leaves the weight part its
// operands, which live in input and weight slots of their own, and
// recomputation runs once, in the input part.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "core/rng.h"
#include "core/timeline.h"
#include "models/llama/llama.h"
#include "tests/models/model_fixture.h"

namespace xirang {
namespace {

ModelDims dims_of(const std::string& arch) {
  if (arch == "gpt2")
    return ModelDims{.arch = "gpt2", .n_layer = 4, .n_head = 2, .d_model = 16, .max_seq_len = 8, .vocab_size = 23,
                     .vocab_multiple = 8};
  // Qwen3: LLaMA's shape with heads 6 wide and a q/k norm.
  ModelDims d{.arch = arch, .n_layer = 4, .n_head = 4, .n_kv_head = 2, .head_dim = arch == "qwen3" ? 6 : 0,
              .d_model = 16, .ffn_hidden = 24, .max_seq_len = 8, .vocab_size = 23, .vocab_multiple = 8};
  d.tie_embeddings = arch == "qwen3";
  return d;
}

// How backward runs: fused, or split with each microbatch's weight part
// right after its input part, or every input part first.
enum class Split { Fused, EachThenWeights, AllInputsFirst };

struct Outcome {
  std::vector<int> ready;                  // the gradient-ready calls, chunk by chunk: 1000 g + layer
  std::vector<double> losses;              // per step: the sum of the microbatches' mean losses
  std::vector<std::vector<uint8_t>> grads;  // every parameter's gradient bytes, chunk by chunk
  std::vector<uint8_t> boundary_grad;      // the gradient the last chunk hands back (two chunks)
  size_t activation_bytes = 0;
};

std::vector<uint8_t> bytes_of(const Tensor& t) {
  std::vector<uint8_t> b(t.bytes());
  std::memcpy(b.data(), t.raw(), t.bytes());
  return b;
}

struct Built {
  std::unique_ptr<ModelChunk> chunk;
  Arena params, grads, acts;
};

// Pipeline chunk g of `chunks` in arenas of its own, with random parameters.
Built build(const std::string& arch, DType dt, int chunks, int g, const ChunkBatch& batch) {
  const ModelDims d = dims_of(arch);
  Built b;
  b.chunk = model_arch(arch).make_chunk(d, ChunkPlacement::of_chunk(d.n_layer, chunks, g), dt, batch, {});
  Arena mp = Arena::measuring("p"), mg = Arena::measuring("g"), ma = Arena::measuring("a");
  b.chunk->layout_parameters(mp, mg);
  b.chunk->layout_activations(ma);
  b.params = Arena("p", mp.used());
  b.grads = Arena("g", mg.used());
  b.acts = Arena("a", ma.used());
  b.chunk->layout_parameters(b.params, b.grads);
  b.chunk->layout_activations(b.acts);
  // Wide random values where the storage allows it (every nonlinearity matters), else the init rules.
  if (dt == DType::F32) randomize_parameters(*b.chunk, 31);
  else b.chunk->init_parameters(31);
  return b;
}

// Two steps of two microbatches through `chunks` pipeline chunks in mode `r`.
// Backward runs the later microbatch first, so the recomputed buffers shared
// by the slots hold the other microbatch's values when a backward starts.
Outcome train(const std::string& arch, DType dt, int chunks, Recompute r, Split split = Split::Fused) {
  const ModelDims d = dims_of(arch);
  const ChunkBatch batch{2, 7, 2, r, split != Split::Fused};
  const int micro = 2;
  std::vector<Built> cs;
  Outcome out;
  bool in_input_part = false;
  for (int g = 0; g < chunks; ++g) {
    cs.push_back(build(arch, dt, chunks, g, batch));
    out.activation_bytes += cs.back().acts.used();
    cs.back().chunk->set_grad_ready_hook([&out, &in_input_part, g](int layer) {
      EXPECT_FALSE(in_input_part) << "the gradient-ready hook fired from an input-gradient part";
      out.ready.push_back(1000 * g + layer);
    });
  }
  const int64_t n = int64_t(batch.micro_batch) * batch.seq_len;
  std::vector<std::vector<int32_t>> tokens(micro), targets(micro);
  std::vector<Tensor> tok(micro), tgt(micro);
  for (int m = 0; m < micro; ++m) {
    for (int64_t i = 0; i < n; ++i) {
      tokens[size_t(m)].push_back(int32_t(rng_below(3, uint64_t(m), uint64_t(i), uint64_t(d.vocab_size))));
      targets[size_t(m)].push_back(int32_t(rng_below(4, uint64_t(m), uint64_t(i), uint64_t(d.vocab_size))));
    }
    tok[size_t(m)] = Tensor(tokens[size_t(m)].data(), {batch.micro_batch, batch.seq_len}, DType::I32);
    tgt[size_t(m)] = Tensor(targets[size_t(m)].data(), {batch.micro_batch, batch.seq_len}, DType::I32);
  }
  KernelContext ctx;
  ModelChunk& last = *cs.back().chunk;
  for (int step = 0; step < 2; ++step) {
    for (int m = 0; m < micro; ++m)
      for (int g = 0; g < chunks; ++g) {
        ModelChunk& c = *cs[size_t(g)].chunk;
        if (g > 0) copy_tensor(c.stage_input(m), cs[size_t(g - 1)].chunk->stage_output(m), nullptr, true);
        c.forward(ctx, m, tok[size_t(m)], tgt[size_t(m)], 1.0 / double(n * micro));
      }
    out.losses.push_back(last.take_loss(ctx));
    const BackwardPart part = split == Split::Fused ? BackwardPart::Full : BackwardPart::InputGrad;
    auto weights = [&](int m) {
      for (int g = chunks - 1; g >= 0; --g)
        cs[size_t(g)].chunk->backward(ctx, m, tok[size_t(m)], GradPhase::Final, Tensor(), BackwardPart::WeightGrad);
    };
    for (int m = micro - 1; m >= 0; --m) {
      Tensor grad;
      in_input_part = part == BackwardPart::InputGrad;
      for (int g = chunks - 1; g >= 0; --g) {
        ModelChunk& c = *cs[size_t(g)].chunk;
        c.backward(ctx, m, tok[size_t(m)], GradPhase::Final, grad, part);
        grad = c.input_grad();
        if (g == chunks - 1 && chunks > 1 && step == 1 && m == 0) out.boundary_grad = bytes_of(grad);
      }
      in_input_part = false;
      if (split == Split::EachThenWeights) weights(m);
    }
    if (split == Split::AllInputsFirst)
      for (int m = micro - 1; m >= 0; --m) weights(m);
  }
  for (auto& b : cs)
    for (const Parameter& p : b.chunk->parameters()) out.grads.push_back(bytes_of(p.grad));
  return out;
}

struct Case {
  std::string arch;
  DType dtype;
  int chunks;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.arch << " " << dtype_name(c.dtype) << " " << c.chunks << " chunk(s)"; }

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return i.param.arch + "_" + dtype_name(i.param.dtype) + "_" + std::to_string(i.param.chunks) + "chunk";
}

class RecomputeIsBitwise : public ::testing::TestWithParam<Case> {};

TEST_P(RecomputeIsBitwise, LossesAndGradientsEqualNone) {
  const Case& c = GetParam();
  const Outcome none = train(c.arch, c.dtype, c.chunks, Recompute::None);
  for (Recompute r : {Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(r));
    const Outcome o = train(c.arch, c.dtype, c.chunks, r);
    ASSERT_EQ(o.losses.size(), none.losses.size());
    for (size_t i = 0; i < o.losses.size(); ++i) {
      EXPECT_EQ(std::memcmp(&o.losses[i], &none.losses[i], sizeof(double)), 0)
          << "step " << i << ": loss " << o.losses[i] << " vs " << none.losses[i];
      EXPECT_GT(none.losses[i], 0.0);
    }
    ASSERT_EQ(o.grads.size(), none.grads.size());
    for (size_t i = 0; i < o.grads.size(); ++i) EXPECT_TRUE(o.grads[i] == none.grads[i]) << "parameter " << i;
    EXPECT_TRUE(o.boundary_grad == none.boundary_grad);
    EXPECT_LT(o.activation_bytes, none.activation_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, RecomputeIsBitwise,
                         ::testing::Values(Case{"gpt2", DType::F32, 1}, Case{"gpt2", DType::F32, 2},
                                           Case{"gpt2", DType::BF16, 2}, Case{"gpt2", DType::F16, 1},
                                           Case{"llama", DType::F32, 1}, Case{"llama", DType::F32, 2},
                                           Case{"llama", DType::BF16, 2}, Case{"llama", DType::F16, 1},
                                           Case{"qwen3", DType::F32, 1}, Case{"qwen3", DType::F32, 2},
                                           Case{"qwen3", DType::BF16, 2}, Case{"qwen3", DType::F16, 1}),
                         case_name);

class SplitBackwardIsBitwise : public ::testing::TestWithParam<Case> {};

TEST_P(SplitBackwardIsBitwise, InputThenWeightPartsEqualTheFusedBackward) {
  const Case& c = GetParam();
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    const Outcome fused = train(c.arch, c.dtype, c.chunks, r);
    ASSERT_FALSE(fused.ready.empty());
    for (Split split : {Split::EachThenWeights, Split::AllInputsFirst}) {
      SCOPED_TRACE(std::string(recompute_name(r)) + (split == Split::EachThenWeights ? ", B W B W" : ", B B W W"));
      const Outcome o = train(c.arch, c.dtype, c.chunks, r, split);
      ASSERT_EQ(o.losses.size(), fused.losses.size());
      for (size_t i = 0; i < o.losses.size(); ++i)
        EXPECT_EQ(std::memcmp(&o.losses[i], &fused.losses[i], sizeof(double)), 0) << "step " << i;
      ASSERT_EQ(o.grads.size(), fused.grads.size());
      for (size_t i = 0; i < o.grads.size(); ++i) EXPECT_TRUE(o.grads[i] == fused.grads[i]) << "parameter " << i;
      EXPECT_TRUE(o.boundary_grad == fused.boundary_grad);
      EXPECT_EQ(o.ready, fused.ready);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, SplitBackwardIsBitwise,
                         ::testing::Values(Case{"gpt2", DType::F32, 1}, Case{"gpt2", DType::F32, 2},
                                           Case{"gpt2", DType::BF16, 2}, Case{"llama", DType::F32, 2},
                                           Case{"llama", DType::F16, 1}, Case{"qwen3", DType::F32, 2},
                                           Case{"qwen3", DType::BF16, 1}),
                         case_name);

// A split backward is refused without its layout, and an input part may
// not overwrite a slot's weight part that has not run.
TEST(SplitBackward, IsCheckedAgainstTheLayout) {
  Built plain = build("llama", DType::F32, 1, 0, ChunkBatch{1, 4, 1});
  EXPECT_FALSE(plain.chunk->splits_backward());
  Built split = build("llama", DType::F32, 1, 0, ChunkBatch{1, 4, 1, Recompute::None, true});
  EXPECT_TRUE(split.chunk->splits_backward());
  std::vector<int32_t> ids(4, 3);
  const Tensor tok(ids.data(), {1, 4}, DType::I32);
  KernelContext ctx;
  EXPECT_THROW(plain.chunk->backward(ctx, 0, tok, GradPhase::Final, Tensor(), BackwardPart::InputGrad), Error);
  split.chunk->forward(ctx, 0, tok, tok, 0.25);
  split.chunk->backward(ctx, 0, tok, GradPhase::Final, Tensor(), BackwardPart::InputGrad);
  EXPECT_THROW(split.chunk->backward(ctx, 0, tok, GradPhase::Final, Tensor(), BackwardPart::InputGrad), Error);
  split.chunk->backward(ctx, 0, tok, GradPhase::Final, Tensor(), BackwardPart::WeightGrad);
  split.chunk->backward(ctx, 0, tok, GradPhase::Final, Tensor(), BackwardPart::InputGrad);
}

// How the second microbatch's slots relate to the first's in reuse_after_input_part.
enum class Reuse {
  Fused,          // the reference: fused backwards, one activation slot
  OwnSlots,       // split; the activation slot reused, input and weight slots of its own
  SharedInputSlot // split; the second microbatch's forward also overwrites the first's input slot
};

// Two steps of two microbatches through `chunks` chunks with one
// activation slot: F(0) B(0) F(1) B(1), then the weight parts W(0) W(1).
// The second forward reuses the activation slot the first microbatch's
// input part has freed, before that microbatch's weight part. With
// `trace`, the step's spans (their "recompute" spans counted by pass).
struct ReuseOutcome {
  Outcome out;
  int recomputes_in_input_parts = 0, recomputes_in_weight_parts = 0;
};
ReuseOutcome reuse_after_input_part(const std::string& arch, int chunks, Recompute r, Reuse reuse) {
  const ModelDims d = dims_of(arch);
  const bool split = reuse != Reuse::Fused;
  // Input and weight slots handed out in reverse (microbatch 0 takes slot 1), unlike the activation slot.
  const ChunkBatch batch{2, 7, 1, r, split, 2, 2};
  const MicrobatchSlots at[2] = {{0, 1, 1}, {0, reuse == Reuse::SharedInputSlot ? 1 : 0, 0}};
  std::vector<Built> cs;
  ReuseOutcome res;
  Outcome& out = res.out;
  for (int g = 0; g < chunks; ++g) {
    cs.push_back(build(arch, DType::F32, chunks, g, batch));
    cs.back().chunk->set_grad_ready_hook([&out, g](int layer) { out.ready.push_back(1000 * g + layer); });
  }
  const int64_t n = int64_t(batch.micro_batch) * batch.seq_len;
  std::vector<int32_t> ids[2][2];
  Tensor tok[2], tgt[2];
  for (int m = 0; m < 2; ++m) {
    for (int k = 0; k < 2; ++k)
      for (int64_t i = 0; i < n; ++i)
        ids[m][k].push_back(int32_t(rng_below(5 + uint64_t(k), uint64_t(m), uint64_t(i), uint64_t(d.vocab_size))));
    tok[m] = Tensor(ids[m][0].data(), {batch.micro_batch, batch.seq_len}, DType::I32);
    tgt[m] = Tensor(ids[m][1].data(), {batch.micro_batch, batch.seq_len}, DType::I32);
  }
  Timeline tl;
  tl.set_tracing(true);
  KernelContext ctx;
  ctx.timeline = &tl;
  auto recomputes = [&tl] {
    int k = 0;
    for (const Span& s : tl.take_spans()) k += std::string(s.name) == "recompute";
    return k;
  };
  const BackwardPart part = split ? BackwardPart::InputGrad : BackwardPart::Full;
  for (int step = 0; step < 2; ++step) {
    for (int m = 0; m < 2; ++m) {
      const MicrobatchSlots slots = split ? at[m] : MicrobatchSlots(0);
      for (int g = 0; g < chunks; ++g) {
        ModelChunk& c = *cs[size_t(g)].chunk;
        if (g > 0) copy_tensor(c.stage_input(0), cs[size_t(g - 1)].chunk->stage_output(0), nullptr, true);
        c.forward(ctx, slots, tok[m], tgt[m], 1.0 / double(2 * n));
      }
      tl.take_spans();
      Tensor grad;
      for (int g = chunks - 1; g >= 0; --g) {
        ModelChunk& c = *cs[size_t(g)].chunk;
        c.backward(ctx, slots, tok[m], GradPhase::Final, grad, part);
        grad = c.input_grad();
        if (g == 1 && step == 1 && m == 1) out.boundary_grad = bytes_of(grad);
      }
      res.recomputes_in_input_parts += recomputes();
    }
    out.losses.push_back(cs.back().chunk->take_loss(ctx));
    if (split)
      for (int m = 0; m < 2; ++m)
        for (int g = chunks - 1; g >= 0; --g)
          cs[size_t(g)].chunk->backward(ctx, at[m], Tensor(), GradPhase::Final, Tensor(), BackwardPart::WeightGrad);
    res.recomputes_in_weight_parts += recomputes();
  }
  for (auto& b : cs)
    for (const Parameter& p : b.chunk->parameters()) out.grads.push_back(bytes_of(p.grad));
  return res;
}

class SplitBackwardAfterSlotReuse : public ::testing::TestWithParam<std::string> {};

// The activation slot is free after the input part, as after a fused
// backward: the next microbatch's forward into it leaves the pending weight
// part its operands (in the microbatch's own input and weight slots), and
// losses, gradients, the boundary gradient and the gradient-ready calls
// equal the fused backward's bit for bit, in every recompute mode.
// Recomputation runs once per layer in the input part, never in the
// weight part.
TEST_P(SplitBackwardAfterSlotReuse, WeightPartKeepsItsOperands) {
  const std::string arch = GetParam();
  const int layers = dims_of(arch).n_layer;
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(r));
    const Outcome fused = reuse_after_input_part(arch, 2, r, Reuse::Fused).out;
    const ReuseOutcome split = reuse_after_input_part(arch, 2, r, Reuse::OwnSlots);
    const Outcome& o = split.out;
    ASSERT_EQ(o.losses.size(), fused.losses.size());
    for (size_t i = 0; i < o.losses.size(); ++i)
      EXPECT_EQ(std::memcmp(&o.losses[i], &fused.losses[i], sizeof(double)), 0) << "step " << i;
    ASSERT_EQ(o.grads.size(), fused.grads.size());
    for (size_t i = 0; i < o.grads.size(); ++i) EXPECT_TRUE(o.grads[i] == fused.grads[i]) << "parameter " << i;
    EXPECT_FALSE(o.boundary_grad.empty());
    EXPECT_TRUE(o.boundary_grad == fused.boundary_grad);
    EXPECT_EQ(o.ready, fused.ready);
    // Two steps of two microbatches, each layer once per input part.
    EXPECT_EQ(split.recomputes_in_input_parts, r == Recompute::None ? 0 : 2 * 2 * layers);
    EXPECT_EQ(split.recomputes_in_weight_parts, 0);
  }
}

// The weight part reads the layer inputs from the microbatch's input slot,
// which must be held until then: a forward of another microbatch into it
// before the weight part changes the weight gradients (and nothing else).
TEST_P(SplitBackwardAfterSlotReuse, InputSlotIsHeldUntilTheWeightPart) {
  const std::string arch = GetParam();
  const Outcome fused = reuse_after_input_part(arch, 2, Recompute::None, Reuse::Fused).out;
  const Outcome shared = reuse_after_input_part(arch, 2, Recompute::None, Reuse::SharedInputSlot).out;
  EXPECT_EQ(std::memcmp(&shared.losses[0], &fused.losses[0], sizeof(double)), 0);
  EXPECT_NE(shared.grads, fused.grads);
}

INSTANTIATE_TEST_SUITE_P(Models, SplitBackwardAfterSlotReuse, ::testing::Values("gpt2", "llama", "qwen3"));

// Full keeps less than selective, selective less than none, per microbatch
// (the difference between two- and one-slot layouts).
TEST(Recompute, EachModeKeepsLessPerMicrobatch) {
  for (const std::string arch : {"gpt2", "llama", "qwen3"}) {
    const ModelDims d = dims_of(arch);
    auto per_slot = [&](Recompute r) {
      size_t used[2];
      for (int s = 1; s <= 2; ++s) {
        auto c = model_arch(arch).make_chunk(d, ChunkPlacement::whole(d.n_layer), DType::F32, {2, 8, s, r}, {});
        Arena ma = Arena::measuring("a");
        c->layout_activations(ma);
        used[s - 1] = ma.used();
      }
      return used[1] - used[0];
    };
    const size_t none = per_slot(Recompute::None), sel = per_slot(Recompute::Selective),
                 full = per_slot(Recompute::Full);
    EXPECT_LT(sel, none) << arch;
    EXPECT_LT(full, sel) << arch;
  }
}

}  // namespace
}  // namespace xirang
