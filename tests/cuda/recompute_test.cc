// Activation recomputation on the device: GPT-2, LLaMA and Qwen3 chunks in
// device arenas, two microbatches in flight, train.recompute selective and
// full against none in each storage dtype. The recomputation re-runs the
// same CUDA kernels (cuBLASLt products, flash attention, GELU, SwiGLU) on
// the same inputs, so the losses and every parameter gradient must be
// bitwise equal; in particular GPT-2's selective mode keeps the GELU output
// under 16-bit storage, where the fused epilogue cannot be reproduced from
// the stored product. Skips without a GPU.
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "models/model.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

ModelDims device_dims(const std::string& arch) {
  if (arch == "gpt2")
    return ModelDims{.arch = "gpt2", .n_layer = 3, .n_head = 2, .d_model = 64, .max_seq_len = 32, .vocab_size = 101,
                     .vocab_multiple = 8};
  // Qwen3: heads 32 wide where d_model / n_head is 16, and the q/k norm kernels.
  ModelDims d{.arch = arch, .n_layer = 3, .n_head = 4, .n_kv_head = 2, .head_dim = arch == "qwen3" ? 32 : 0,
              .d_model = 64, .ffn_hidden = 96, .max_seq_len = 32, .vocab_size = 101, .vocab_multiple = 8};
  d.tie_embeddings = arch == "qwen3";
  return d;
}

struct DeviceRun {
  double loss = 0;
  std::vector<std::vector<uint8_t>> grads;
};

// `split`: each backward as its input-gradient part, then every weight-gradient part.
DeviceRun run(const KernelContext& ctx, const std::string& arch, DType dt, Recompute r, bool split = false) {
  const ModelDims d = device_dims(arch);
  const ChunkBatch batch{2, 32, 2, r, split};
  auto chunk = model_arch(arch).make_chunk(d, ChunkPlacement::whole(d.n_layer), dt, batch, {});
  Arena mp = Arena::measuring("p"), mg = Arena::measuring("g"), ma = Arena::measuring("a");
  chunk->layout_parameters(mp, mg);
  chunk->layout_activations(ma);
  Arena params("p", mp.used(), Device::CUDA), grads("g", mg.used(), Device::CUDA), acts("a", ma.used(), Device::CUDA);
  chunk->layout_parameters(params, grads);
  chunk->layout_activations(acts);
  chunk->init_parameters(7);
  for (const Parameter& p : chunk->parameters()) XR_CUDA_CHECK(cudaMemset(p.grad.raw(), 0, p.grad.bytes()));
  std::vector<DeviceTensor> tok, tgt;
  for (int m = 0; m < 2; ++m) {
    tok.push_back(to_device(random_tokens({batch.micro_batch, batch.seq_len}, 11 + m, 0, d.vocab_size)));
    tgt.push_back(to_device(random_tokens({batch.micro_batch, batch.seq_len}, 21 + m, 0, d.vocab_size)));
  }
  const double dloss = 1.0 / (2.0 * batch.micro_batch * batch.seq_len);
  for (int m = 0; m < 2; ++m) chunk->forward(ctx, m, tok[size_t(m)], tgt[size_t(m)], dloss);
  DeviceRun out;
  out.loss = chunk->take_loss(ctx);
  // The later microbatch first: the shared recomputation buffers hold the other one's values.
  const BackwardPart part = split ? BackwardPart::InputGrad : BackwardPart::Full;
  for (int m = 1; m >= 0; --m) chunk->backward(ctx, m, tok[size_t(m)], GradPhase::Final, Tensor(), part);
  if (split)
    for (int m = 1; m >= 0; --m)
      chunk->backward(ctx, m, tok[size_t(m)], GradPhase::Final, Tensor(), BackwardPart::WeightGrad);
  for (const Parameter& p : chunk->parameters()) {
    const HostTensor h = to_host(p.grad);
    const auto* b = static_cast<const uint8_t*>(h.tensor().raw());
    out.grads.emplace_back(b, b + h.tensor().bytes());
  }
  return out;
}

class RecomputeOnDevice : public CudaDTypeTest {};

TEST_P(RecomputeOnDevice, LossesAndGradientsBitwiseEqualNone) {
  const DType dt = GetParam();
  for (const std::string arch : {"gpt2", "llama", "qwen3"}) {
    const DeviceRun none = run(ctx(), arch, dt, Recompute::None);
    EXPECT_GT(none.loss, 0.0) << arch;
    for (Recompute r : {Recompute::Selective, Recompute::Full}) {
      SCOPED_TRACE(arch + " " + recompute_name(r));
      const DeviceRun o = run(ctx(), arch, dt, r);
      EXPECT_EQ(std::memcmp(&o.loss, &none.loss, sizeof(double)), 0) << o.loss << " vs " << none.loss;
      ASSERT_EQ(o.grads.size(), none.grads.size());
      for (size_t i = 0; i < o.grads.size(); ++i) EXPECT_TRUE(o.grads[i] == none.grads[i]) << "parameter " << i;
    }
  }
}

XR_INSTANTIATE_STORAGE_DTYPES(RecomputeOnDevice);

// The backward split into its input- and weight-gradient parts (the
// operands of the deferred products copied on the stream) gives the fused
// backward's gradients bit for bit.
class SplitBackwardOnDevice : public CudaDTypeTest {};

TEST_P(SplitBackwardOnDevice, InputThenWeightPartsEqualTheFusedBackward) {
  const DType dt = GetParam();
  for (const std::string arch : {"gpt2", "llama", "qwen3"})
    for (Recompute r : {Recompute::None, Recompute::Full}) {
      SCOPED_TRACE(arch + " " + recompute_name(r));
      const DeviceRun fused = run(ctx(), arch, dt, r), split = run(ctx(), arch, dt, r, true);
      EXPECT_EQ(std::memcmp(&split.loss, &fused.loss, sizeof(double)), 0);
      ASSERT_EQ(split.grads.size(), fused.grads.size());
      for (size_t i = 0; i < split.grads.size(); ++i) EXPECT_TRUE(split.grads[i] == fused.grads[i]) << "parameter " << i;
    }
}

XR_INSTANTIATE_STORAGE_DTYPES(SplitBackwardOnDevice);

}  // namespace
}  // namespace xirang::test
