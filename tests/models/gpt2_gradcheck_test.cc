// Finite-difference check of GPT2's hand-written backward pass, in float64,
// for every parameter tensor of a tiny model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/rng.h"
#include "models/gpt2/gpt2.h"
#include "tests/kernels/gradcheck.h"
#include "tests/models/model_fixture.h"

namespace xirang {
namespace {

struct TinyModel {
  ModelDims shape{.n_layer = 2, .n_head = 2, .d_model = 8, .max_seq_len = 6, .vocab_size = 11, .vocab_multiple = 16};
  ChunkBatch batch{2, 5, 1};
  ModelInArenas built;
  GPT2& model = built.model;
  std::vector<int32_t> tokens, targets;
  Tensor tok, tgt;

  explicit TinyModel(DType dt) : built(shape, ChunkPlacement::whole(shape.n_layer), dt, batch) {
    const int64_t n = int64_t(batch.micro_batch) * batch.seq_len;
    for (int64_t i = 0; i < n; ++i) {
      tokens.push_back(int32_t(rng_below(7, 1, uint64_t(i), uint64_t(shape.vocab_size))));
      targets.push_back(int32_t(rng_below(7, 2, uint64_t(i), uint64_t(shape.vocab_size))));
    }
    tok = Tensor(tokens.data(), {batch.micro_batch, batch.seq_len}, DType::I32);
    tgt = Tensor(targets.data(), {batch.micro_batch, batch.seq_len}, DType::I32);
  }

  void randomize(uint64_t seed) { randomize_parameters(model, seed); }

  double loss() {
    model.forward(KernelContext{}, 0, tok, tgt, 0.0);
    return model.take_loss(KernelContext{});
  }
};

TEST(GPT2GradCheck, EveryParameterTensorMatchesFiniteDifferences) {
  TinyModel m(DType::F64);
  m.randomize(99);
  KernelContext ctx;
  for (auto& p : m.model.parameters()) std::memset(p.grad.raw(), 0, p.grad.bytes());
  const double n_tokens = double(m.batch.micro_batch) * m.batch.seq_len;
  m.model.forward(ctx, 0, m.tok, m.tgt, 1.0 / n_tokens);
  m.model.take_loss(ctx);  // the finite differences below start from an empty loss sum
  m.model.backward(ctx, 0, m.tok);

  const double h = 1e-5;
  int checked_tensors = 0;
  for (auto& p : m.model.parameters()) {
    double* v = p.value.data<double>();
    const double* g = p.grad.data<double>();
    const int64_t n = p.value.numel();
    // Up to 12 elements per tensor, spread over it at random; rows of the
    // token embedding past the real vocabulary get no gradient and are skipped.
    const int64_t limit = p.name == "wte.weight" ? int64_t(m.shape.vocab_size) * m.shape.d_model : n;
    const int64_t samples = std::min<int64_t>(12, limit);
    double max_rel = 0;
    for (int64_t k = 0; k < samples; ++k) {
      const int64_t i = samples == limit ? k : int64_t(rng_below(5, name_stream(p.name), uint64_t(k), uint64_t(limit)));
      const double fd = test::central_difference(v[i], h, [&] { return m.loss(); });
      const double rel = std::abs(fd - g[i]) / std::max(1e-7, std::abs(fd) + std::abs(g[i]));
      max_rel = std::max(max_rel, rel);
      EXPECT_LT(rel, 1e-5) << p.name << "[" << i << "]: finite difference " << fd << ", backward " << g[i];
    }
    ++checked_tensors;
    // The check must not pass vacuously: some gradient in the tensor is not tiny.
    double norm = 0;
    for (int64_t i = 0; i < limit; ++i) norm += g[i] * g[i];
    EXPECT_GT(norm, 1e-12) << p.name << " has an all-zero gradient";
  }
  EXPECT_EQ(checked_tensors, 2 + 12 * m.shape.n_layer + 2);
}

TEST(GPT2GradCheck, PaddedVocabularyLogitsGetNoGradient) {
  TinyModel m(DType::F64);
  m.randomize(3);
  KernelContext ctx;
  for (auto& p : m.model.parameters()) std::memset(p.grad.raw(), 0, p.grad.bytes());
  m.model.forward(ctx, 0, m.tok, m.tgt, 0.1);
  m.model.take_loss(ctx);
  m.model.backward(ctx, 0, m.tok);
  const Parameter& wte = m.model.parameters().front();
  ASSERT_EQ(wte.name, "wte.weight");
  const double* g = wte.grad.data<double>();
  for (int64_t i = int64_t(m.shape.vocab_size) * m.shape.d_model; i < wte.grad.numel(); ++i) EXPECT_EQ(g[i], 0.0);
}

TEST(GPT2, Float32ForwardTracksFloat64) {
  TinyModel a(DType::F64), b(DType::F32);
  a.randomize(11);
  b.randomize(11);
  EXPECT_NEAR(a.loss(), b.loss(), 1e-5 * std::abs(a.loss()));
}

TEST(GPT2, InitIsAFunctionOfSeedAndName) {
  TinyModel a(DType::F32), b(DType::F32);
  a.model.init_parameters(42);
  b.model.init_parameters(42);
  for (size_t i = 0; i < a.model.parameters().size(); ++i) {
    auto& pa = a.model.parameters()[i];
    auto& pb = b.model.parameters()[i];
    EXPECT_EQ(0, std::memcmp(pa.value.raw(), pb.value.raw(), pa.value.bytes())) << pa.name;
  }
  b.model.init_parameters(43);
  auto& wa = a.model.parameters()[0];
  auto& wb = b.model.parameters()[0];
  EXPECT_NE(0, std::memcmp(wa.value.raw(), wb.value.raw(), wa.value.bytes()));
  // GPT-2 init: weights ~ N(0, 0.02); the padding rows of wte are zero.
  const float* w = wa.value.data<float>();
  double s = 0;
  const int64_t real = int64_t(a.shape.vocab_size) * a.shape.d_model;
  for (int64_t i = 0; i < real; ++i) s += double(w[i]) * w[i];
  EXPECT_NEAR(std::sqrt(s / double(real)), 0.02, 0.006);
  for (int64_t i = real; i < wa.value.numel(); ++i) EXPECT_EQ(w[i], 0.0f);
}

}  // namespace
}  // namespace xirang
